// The pipeline schedule plugins. In ABI 1.0 a schedule table carries the
// facts the pipeline split needs (stages per rank, placement, whether backward
// is split into I and W); action generation is appended by a later minor. So
// the schedules differ by data alone: this file is built once per schedule,
// and MESHRUN_SCHEDULE_NAME picks its row of kSchedules.
#include <cstddef>
#include <iterator>
#include <string_view>

#include "meshrun/plugin.hpp"

namespace {

struct ScheduleFacts {
  std::string_view name;
  int32_t stages_per_rank;
  int32_t placement;
  int32_t splits_backward;
  const char* description;
};

constexpr ScheduleFacts kSchedules[] = {
    {"gpipe", 1, MESHRUN_PLACEMENT_LOOP, 0,
     "GPipe: all forwards, then all backwards; one stage per rank. ABI 1.0 table: stage placement "
     "only, actions not yet implemented"},
    {"1f1b", 1, MESHRUN_PLACEMENT_LOOP, 0,
     "1F1B: warm-up forwards, then one forward one backward; one stage per rank. ABI 1.0 table: "
     "stage placement only, actions not yet implemented"},
    {"interleaved_1f1b", 2, MESHRUN_PLACEMENT_LOOP, 0,
     "Interleaved 1F1B: 1F1B over several looped virtual stages per rank. ABI 1.0 table: stage "
     "placement only, actions not yet implemented"},
    {"looped_bfs", 2, MESHRUN_PLACEMENT_LOOP, 0,
     "Looped BFS: breadth-first, every micro-batch through one local stage before the next. ABI "
     "1.0 table: stage placement only, actions not yet implemented"},
    {"interleaved_zero_bubble", 2, MESHRUN_PLACEMENT_LOOP, 1,
     "Interleaved zero bubble: looped stages, backward split into input (I) and weight (W) "
     "parts that fill the bubbles. ABI 1.0 table: stage placement only, actions not yet "
     "implemented"},
    {"zbv_zero_bubble", 2, MESHRUN_PLACEMENT_V, 1,
     "ZBV zero bubble: two stages per rank in a V, backward split into I and W. ABI 1.0 table: "
     "stage placement only, actions not yet implemented"},
    {"dualpipev", 2, MESHRUN_PLACEMENT_V, 1,
     "DualPipeV (DeepSeek-V3): two stages per rank in a V, forward and backward of two "
     "micro-batches overlapped, backward split into I and W. ABI 1.0 table: stage placement only, "
     "actions not yet implemented"},
};

constexpr size_t row_of(std::string_view name) {
  size_t row = 0;
  while (row < std::size(kSchedules) && kSchedules[row].name != name) ++row;
  return row;
}

constexpr size_t kRow = row_of(MESHRUN_SCHEDULE_NAME);
static_assert(kRow < std::size(kSchedules), "MESHRUN_SCHEDULE_NAME names no row of kSchedules");

const meshrun_schedule_api kScheduleApi = {
    sizeof(meshrun_schedule_api),
    kSchedules[kRow].stages_per_rank,
    kSchedules[kRow].placement,
    kSchedules[kRow].splits_backward,
    nullptr,
};

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SCHEDULE,
    MESHRUN_SCHEDULE_NAME,
    MESHRUN_PLUGIN_VERSION,
    kSchedules[kRow].description,
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    &kScheduleApi,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
