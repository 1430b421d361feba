// The compute order of the shipped schedules, following the algorithms of
// PyTorch's torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B,
// ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
// ScheduleZBVZeroBubble, ScheduleDualPipeV) without their idle padding: each
// returns, per rank, the F, B, I and W actions in execution order. The host
// adds the communication.
//
// Each generator checks the sizes its schedule accepts and throws
// meshrun::plugin::Error INVALID_ARGUMENT naming the constraint otherwise.
// One file per family: fill_drain.cpp (gpipe, looped_bfs), one_f_one_b.cpp
// (1f1b, interleaved_1f1b, interleaved_zero_bubble), zbv.cpp, dualpipev.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshrun/schedule.hpp"

namespace meshrun::schedules {

using schedule::Action;
using schedule::ActionType;

// Every rank's actions, rank 0 first.
using RankActions = std::vector<std::vector<Action>>;

// What a schedule is generated for; all at least 1 (checked by the caller).
struct Sizes {
  int64_t pp = 1;               // ranks
  int64_t stages_per_rank = 1;  // v
  int64_t microbatches = 1;     // m
};

RankActions gpipe(const Sizes& sizes);
RankActions looped_bfs(const Sizes& sizes);
RankActions one_f_one_b(const Sizes& sizes);
RankActions interleaved_1f1b(const Sizes& sizes);
RankActions interleaved_zero_bubble(const Sizes& sizes);
RankActions zbv_zero_bubble(const Sizes& sizes);
RankActions dualpipev(const Sizes& sizes);

// Throws INVALID_ARGUMENT "<schedule> needs <constraint>, got <what>".
[[noreturn]] void refuse(const std::string& schedule, const std::string& constraint,
                         const std::string& got);

// Refuses unless sizes.stages_per_rank == expected; `why` says what makes it so.
void require_stages_per_rank(const std::string& schedule, const Sizes& sizes, int64_t expected,
                             const std::string& why);

}  // namespace meshrun::schedules
