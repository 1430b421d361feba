// Where a rank computes. AutoModel's dist_env.backend picks it: "nccl" puts
// each rank on a CUDA GPU (local_rank % the devices the process sees),
// "gloo" and "mpi" on the CPU (docs/config.md).
#pragma once

#include <string>

#include "config/config.hpp"

namespace meshrun {

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied), as the
// NVIDIA driver counts them. The driver (libcuda.so.1) is loaded at run
// time, so meshrun runs where there is none; `why_none` says why `count`
// is 0.
struct CudaDevices {
  int count = 0;
  std::string why_none;
};
CudaDevices cuda_devices();

// Throws the input error at dist_env.backend when the config asks for CUDA
// and `devices` has none, before any rank starts.
void require_usable_devices(const Config& config, const CudaDevices& devices);

}  // namespace meshrun
