// The MegatronFSDPConfig keys of the [distributed] object megatron_fsdp
// reads, with AutoModel's defaults, as the sharding engine's options.
#pragma once

#include "sharding/engine.hpp"

namespace meshrun::megatron_fsdp {

// zero_dp_strategy, what stays sharded over dp between uses:
//   1: the optimizer state. Parameters are gathered once per step and kept;
//      a unit's gradients accumulate whole over the micro-batches and are
//      reduce-scattered once, in the last micro-batch's backward.
//   2: + the gradients. Each micro-batch reduce-scatters its unit gradients
//      into the shard.
//   3: + the parameters. A unit is gathered before its forward and its
//      backward and freed after each (the last layer keeps it from its
//      forward to its backward).
// overlap_grad_reduce starts a unit's reduce-scatter right after its
// backward (else at the micro-batch's end); overlap_param_gather starts the
// gather of the next unit, one ahead in forward and in backward as
// Megatron-FSDP does (else each gather waits where it is needed).
// average_in_collective averages in the collectives (else, AutoModel's
// default, each rank scales its gradients by 1 / dp and the collectives
// sum); report_nan_in_param_grad checks each unit's gradients before their
// reduction (sharding::EngineOptions). Parameters are gathered and gradients
// reduced in float32, the models' dtype. INVALID_ARGUMENT naming the key for a value of the wrong
// type or range, and for zero_dp_strategy 0.
sharding::EngineOptions parse_options(const char* options_json);

// check_for_nan_in_grad: true is accepted and does nothing, as in
// megatron-fsdp 0.5.0, where report_nan_in_param_grad replaced it; setup
// says so once.
bool checks_for_nan_in_grad(const char* options_json);

}  // namespace meshrun::megatron_fsdp
