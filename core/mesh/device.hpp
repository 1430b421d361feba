// Where a rank computes. AutoModel's dist_env.backend picks it: "nccl" puts
// each rank on a CUDA GPU (local_rank % the devices the process sees),
// "gloo" and "mpi" on the CPU (docs/config.md).
#pragma once

#include <cstdint>
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

// The GPU of a rank that is `local_rank` on its node, among `count` GPUs the
// process sees: local_rank % count, AutoModel's placement.
int32_t gpu_of_local_rank(int64_t local_rank, int count);

// This process's GPU as rank `rank` of a CUDA run: gpu_of_local_rank of the
// launcher's local rank (`rank` where the launcher does not say) and the
// GPUs the process sees (CUDA_VISIBLE_DEVICES applied). Throws UNAVAILABLE
// naming `rank` when it sees none, saying why.
int32_t launched_rank_gpu(int64_t rank);

// Before any rank starts, when the config asks for CUDA: throws the input
// error at dist_env.backend when `devices` has none, and at
// --nproc-per-node when a node would start more ranks than the GPUs it
// sees (NCCL refuses two ranks of a communicator on one GPU, "Duplicate
// GPU detected", so local_rank % count never wraps in a run that starts).
void require_usable_devices(const Config& config, const CudaDevices& devices,
                            int64_t ranks_per_node = 1);

}  // namespace meshrun
