// The plugin tables of the shipped schedules, compiled once into
// meshrun_schedule_generators (schedule.cpp); each schedule plugin compiles
// only entry.cpp, which names its table.
#pragma once

#include <string_view>

#include "meshrun/plugin.h"

namespace meshrun::schedules {

// The table of the shipped schedule `name`; nullptr when no schedule has that
// name, which the loader refuses as a plugin without a table.
const meshrun_plugin_api* plugin_api(std::string_view name);

}  // namespace meshrun::schedules
