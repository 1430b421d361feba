// The GPU's GEMM peak, measured by libmeshrun_cuda_peak.so
// (numeric/cuda/peak_entry.h), which this loads at run time from the
// library folder (plugin/loader.hpp's library_dir), so that nothing here
// links a CUDA library and meshrun still runs where there is none.
#pragma once

#include <cstdint>
#include <string>

namespace meshrun::train {

struct CudaPeak {
  std::string device_name;
  double gemm_flops_per_s = 0;  // bfloat16 GEMM, float32 accumulation
  double copy_bytes_per_s = 0;  // device to device, read plus written
};

// Measures CUDA device `device` with GEMMs of size `n`, about `seconds` per
// figure. Throws INVALID_ARGUMENT (the caller asked for what is not here)
// when the machine has no usable CUDA device, `device` is past its count,
// or this build has no CUDA peak library; INTERNAL when the measurement
// fails.
CudaPeak measure_cuda_peak(int32_t device, int64_t n, double seconds);

}  // namespace meshrun::train
