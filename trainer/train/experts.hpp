// What the trainers share for a mixture of experts (docs/model.md): its
// parameters split into the dense ones and the rank's experts, each set
// with a strategy instance of its own, and the routers' statistics per
// step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/model.hpp"
#include "train/metrics.hpp"

namespace meshrun::train {

// The contents' dense parameters and expert parameters, each with the
// units they are in.
std::pair<StageContents, StageContents> split_experts(const ModelDescription& description,
                                                      const StageContents& contents);

// The experts' strategy options under expert parallelism: FSDP2 over
// ep_shard, which spans the data-parallel ranks of an ep coordinate (no
// replicas), with [distributed.moe]'s reshard_after_forward.
std::string expert_options(const Config& config, const std::string& options);

// The step's ExpertMetrics from each rank's statistics: the load-balancing
// losses summed over `over` and divided by `micro_batches` (a rank's
// micro-batches x the data-parallel ranks), the expert counts summed, and
// this rank's ep traffic. Collective over `over`; nullopt (on every rank)
// for a model without experts.
std::optional<ExpertMetrics> gather_expert_metrics(const std::optional<RouterStatistics>& local,
                                                   const ModelDescription& description,
                                                   double micro_batches, const CommTraffic& traffic,
                                                   Communicator& over);

}  // namespace meshrun::train
