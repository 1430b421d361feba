// The size checks the generators share.
#include "meshrun/plugin.hpp"
#include "schedules/generators.hpp"

namespace meshrun::schedules {

void refuse(const std::string& schedule, const std::string& constraint, const std::string& got) {
  throw plugin::Error(MESHRUN_INVALID_ARGUMENT, schedule + " needs " + constraint + ", got " + got);
}

void require_stages_per_rank(const std::string& schedule, const Sizes& sizes, int64_t expected,
                             const std::string& why) {
  if (sizes.stages_per_rank == expected) return;
  refuse(schedule, "stages_per_rank == " + std::to_string(expected) + " (" + why + ")",
         std::to_string(sizes.stages_per_rank));
}

}  // namespace meshrun::schedules
