// The FSDP2Config keys of the [distributed] object fsdp2 reads, with
// AutoModel's defaults, as the sharding engine's options.
#pragma once

#include "sharding/engine.hpp"

namespace meshrun::fsdp2 {

// INVALID_ARGUMENT naming the key for a value of the wrong type or range.
// mp_policy's output_dtype and cast_forward_inputs are the host's to apply
// and are only checked here.
sharding::EngineOptions parse_options(const char* options_json);

}  // namespace meshrun::fsdp2
