// Where a training run's GEMM peak comes from (what metrics' mfu divides
// by): the MESHRUN_GEMM_PEAK_FLOPS variable where it states one, else a
// measurement through the models' own GEMMs (numeric/peak.hpp). Shared by
// `meshrun train` and the host API's meshrun_run_train.
#pragma once

#include "train/throughput.hpp"

namespace meshrun::train {

// The meter both use. Throws INVALID_ARGUMENT naming MESHRUN_GEMM_PEAK_FLOPS
// and the entry when the variable is malformed.
GemmPeakMeter gemm_peak_meter();

}  // namespace meshrun::train
