// Checks of what a host hands a strategy: the setup struct's common part,
// the parameter layout, flat float32 tensors, and gradient ranges.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshrun/strategy.h"

namespace meshrun::strategies {

// Checks `setup` is non-NULL, at least `minimum_size` bytes (the ABI minor
// the strategy needs, named by `abi`), with a comm table of ABI 1.1 and a
// data-parallel communicator, and that its parameter layout is sound:
// num_parameters >= 0, offsets from 0 and non-decreasing, every name set.
void check_setup(const meshrun_strategy_setup* setup, size_t minimum_size, const char* abi);

// `input` as a setup without buffers or communicators, for the checks and
// layouts setup reads from the same fields; its layout checked as setup's.
meshrun_strategy_setup setup_of(const meshrun_strategy_plan_input* input);

// Checks `tensor` (called `what` in messages) is a compact one-dimensional
// float32 view of `numel` elements on `device_type`; its data may be NULL
// only with `data_may_be_null`.
void check_flat_float32(const DLTensor& tensor, const std::string& what, int64_t numel,
                        int32_t device_type, bool data_may_be_null = false);

// The index of the first parameter of element range [begin, end) of the
// layout `offsets` describes (num_parameters + 1 entries); OUT_OF_RANGE
// when the range leaves the buffer, INVALID_ARGUMENT when it splits a
// parameter.
size_t first_parameter_of_range(const std::vector<int64_t>& offsets, int64_t begin, int64_t end);

}  // namespace meshrun::strategies
