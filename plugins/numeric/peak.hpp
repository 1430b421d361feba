// The machine's GEMM peak, what MFU is measured against: `meshrun bench
// peak` and the start of every training run. A GEMM through oneDNN, the
// library the shipped models compute with (docs/decisions.md, "GEMMs
// through oneDNN"), float32 or bfloat16 operands with float32
// accumulation, on one thread per core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshrun {

// The FLOP/s the calling thread sustains on square GEMMs of `size` in
// `dtype` ("float32" or "bfloat16": float32 where the CPU lacks bfloat16
// instructions, as the models' GEMMs) over about `seconds` (one untimed GEMM
// first: oneDNN compiles its kernel), counting 2 size^3 per GEMM. A mean over
// the window, not the best GEMM: ranks sharing a core measure their share.
// Runs oneDNN on one OpenMP thread. Throws std::invalid_argument for another
// dtype, std::runtime_error when oneDNN fails.
double gemm_flops_per_s(const std::string& dtype, double seconds, int64_t size = 512);

// Seconds the calling thread takes for one linear's forward and backward
// through the models' own GEMM (numeric/gemm.hpp: oneDNN, operands
// converted to bfloat16 on each call where `dtype` is "bfloat16", but W
// when `weight_in_bfloat16`, as a strategy gathering in bfloat16 lends it):
// y = x W^T, dx = dy W and dW += dy^T x for x [m, k] and W [n, k], the mean
// over at least 3 rounds and about `seconds`. Throws std::invalid_argument
// for another dtype, a size below 1, or a bfloat16 W under float32.
double linear_seconds(const std::string& dtype, int64_t m, int64_t k, int64_t n, double seconds,
                      bool weight_in_bfloat16 = false);

struct PeakResult {
  std::string dtype;
  int64_t threads = 0;
  double flops_per_s = 0;             // all threads together
  double flops_per_s_per_thread = 0;  // the mean thread's
};

// `meshrun bench peak`: gemm_flops_per_s on `threads` threads at once, for
// each dtype.
std::vector<PeakResult> run_peak_bench(const std::vector<std::string>& dtypes, int64_t threads,
                                       double seconds);

}  // namespace meshrun
