// Where a training run's GEMM peak comes from (what metrics' mfu divides
// by): the MESHRUN_GEMM_PEAK_FLOPS variable where it states one, else a
// measurement through the models' own GEMMs (numeric/peak.hpp), or on a
// GPU through cuBLASLt (cuda_peak.hpp). Shared by
// `meshrun train` and the host API's meshrun_run_train.
#pragma once

#include "train/throughput.hpp"

namespace meshrun::train {

// The meter both use. Throws INVALID_ARGUMENT naming MESHRUN_GEMM_PEAK_FLOPS
// and the entry when the variable is malformed. `on_cuda` (a run with
// dist_env.backend = "nccl"): the rank's GPU is measured instead
// (cuda_peak.hpp: its bfloat16 GEMM rate, whatever the matmul dtype, an
// 8192^3 GEMM, for at least a quarter of a second).
GemmPeakMeter gemm_peak_meter(bool on_cuda = false);

}  // namespace meshrun::train
