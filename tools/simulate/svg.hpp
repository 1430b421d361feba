// The picture of a simulated schedule (`meshrun schedule --svg`): one row
// per rank, time to the right, a block per compute action coloured by its
// type (F, B, I, W; a lighter shade for each later stage a rank holds) with
// its microbatch number in it, idle time left blank. Large schedules are
// scaled to a bounded width and lose the numbers that no longer fit.
#pragma once

#include <string>

#include "schedule/schedule.hpp"
#include "simulate/simulate.hpp"

namespace meshrun::schedule {

// A standalone SVG document for `simulation`, the simulation of `schedule`.
std::string to_svg(const Schedule& schedule, const Simulation& simulation);

}  // namespace meshrun::schedule
