// A rank's CUDA GPU in a training run (dist_env.backend = "nccl"): the
// device, the two streams the run orders its work on, the state device the
// trainer keeps parameters, gradients and moments in, and how much of the
// GPU's memory is in use. Made by libmeshrun_trainer_cuda.so, which the
// trainer loads at run time (rank_gpu.cpp), so that `meshrun` links no
// CUDA library and runs where there is none.
//
// The boundary is internal (both sides are built from this tree and
// installed side by side) and carries C++ objects: the trainer deletes a
// RankGpu through its virtual destructor, and its calls throw
// std::runtime_error.
//
// The streams: the model stage computes and the state device's calls run
// on the compute stream; the strategies' collectives and casts run on the
// comm stream (ABI 1.13), ordered against the compute stream by events.
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "state/state_device.hpp"

namespace meshrun::train {

// The GPU's memory as a run's metrics report it (mem.device_*).
struct GpuMemoryPeaks {
  // The most of the GPU's memory in use at the samples (cudaMemGetInfo:
  // total - free, every allocation of the process and the CUDA context
  // included).
  int64_t used = 0;
  // The high-water mark of the device's stream-ordered pool since the
  // GPU was opened (cudaMemPoolAttrUsedMemHigh): the state, the
  // activations and a pipeline's buffers, allocated stream-ordered; the
  // strategies' buffers (cudaMalloc'd, mem.buffers_*) are not in it.
  int64_t allocated = 0;
};

class RankGpu {
 public:
  virtual ~RankGpu() = default;

  // The CUDA device ordinal (CUDA_VISIBLE_DEVICES applied).
  virtual int32_t device() const = 0;
  // The parameters', gradients' and moments' device, enqueuing on the
  // compute stream (its stream()).
  virtual StateDevice& state() = 0;
  // The stream the strategies' collectives run on (a cudaStream_t).
  virtual void* comm_stream() const = 0;
  // Samples the GPU's memory in use (GpuMemoryPeaks::used), at the points
  // the trainer holds most.
  virtual void sample_memory() = 0;
  // The peaks so far (sampling once more).
  virtual GpuMemoryPeaks memory_peaks() = 0;
};

// The library's file name, looked for in the library folder (library_dir),
// and its one exported function: makes the RankGpu of CUDA device `device`
// (made the calling thread's current device) and sets *out (owned by the
// caller), returning 0; else returns nonzero with the reason in *why.
#define MESHRUN_TRAINER_CUDA_LIBRARY "libmeshrun_trainer_cuda.so"
#define MESHRUN_TRAINER_CUDA_SYMBOL "meshrun_trainer_cuda_rank_gpu"
extern "C" {
typedef int32_t (*meshrun_trainer_cuda_rank_gpu_fn)(int32_t device, RankGpu** out,
                                                    std::string* why);
}

// Loads libmeshrun_trainer_cuda.so and makes `device`'s RankGpu. Throws
// meshrun::Error naming `rank` and the device: UNAVAILABLE when the build
// has no such library (built without the CUDA toolkit) or the device
// cannot be used, with the reason.
std::unique_ptr<RankGpu> open_rank_gpu(int32_t device, int64_t rank);

}  // namespace meshrun::train
