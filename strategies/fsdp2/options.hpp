// The FSDP2Config keys of the [distributed] object fsdp2 reads, with
// AutoModel's defaults.
#pragma once

#include <cstdint>
#include <optional>

#include "precision.hpp"

namespace meshrun::fsdp2 {

struct Options {
  int64_t pp_size = 1;
  // Unset: AutoModel's heuristic (see Fsdp2::reshards_after_forward).
  std::optional<bool> reshard_after_forward;
  // Non-sync micro-batches keep their unit gradients unreduced (no_sync).
  bool defer_grad_sync = true;
  bool prefetch = true;
  int64_t forward_prefetch_depth = 1;
  int64_t backward_prefetch_depth = 2;
  // mp_policy: the all-gather and the reduction dtypes. Its output_dtype and
  // cast_forward_inputs are the host's to apply and are only checked here.
  Dtype param_dtype = Dtype::bfloat16;
  Dtype reduce_dtype = Dtype::float32;
};

// INVALID_ARGUMENT naming the key for a value of the wrong type or range.
Options parse_options(const char* options_json);

}  // namespace meshrun::fsdp2
