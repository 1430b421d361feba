#include "schedules/table.hpp"

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) {
  return meshrun::schedules::plugin_api(MESHRUN_SCHEDULE_NAME);
}
