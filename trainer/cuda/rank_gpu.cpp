// libmeshrun_trainer_cuda.so's one function (train/rank_gpu.hpp): a rank's
// GPU with its compute and comm streams and its state device.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/state_device.hpp"
#include "train/rank_gpu.hpp"

namespace meshrun::train::cuda {
namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(status));
  }
}

class CudaRankGpu : public RankGpu {
 public:
  explicit CudaRankGpu(int32_t device) : device_(device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    // Non-blocking: neither stream waits for the legacy default stream,
    // which NCCL and the libraries never use here.
    check(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking),
          "cudaStreamCreate (compute)");
    check(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking), "cudaStreamCreate (comm)");
    state_ = make_state_device(device, compute_);
  }
  ~CudaRankGpu() override {
    state_.reset();
    cudaDeviceSynchronize();
    cudaStreamDestroy(comm_);
    cudaStreamDestroy(compute_);
  }

  int32_t device() const override { return device_; }
  StateDevice& state() override { return *state_; }
  void* comm_stream() const override { return comm_; }
  void sample_memory() override {
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    used_peak_ = std::max(used_peak_, static_cast<int64_t>(total - free));
  }
  GpuMemoryPeaks memory_peaks() override {
    sample_memory();
    cudaMemPool_t pool = nullptr;
    check(cudaDeviceGetDefaultMemPool(&pool, device_), "cudaDeviceGetDefaultMemPool");
    unsigned long long high = 0;  // cuuint64_t, as the attribute is
    check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high),
          "cudaMemPoolGetAttribute (used high)");
    return {used_peak_, static_cast<int64_t>(high)};
  }

 private:
  int32_t device_;
  int64_t used_peak_ = 0;
  cudaStream_t compute_ = nullptr;
  cudaStream_t comm_ = nullptr;
  std::unique_ptr<StateDevice> state_;
};

}  // namespace
}  // namespace meshrun::train::cuda

extern "C" __attribute__((visibility("default"))) int32_t meshrun_trainer_cuda_rank_gpu(
    int32_t device, meshrun::train::RankGpu** out, std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = "no usable CUDA device (" +
           std::string(status != cudaSuccess ? cudaGetErrorString(status) : "none found") + ")";
    return 1;
  }
  if (device < 0 || device >= count) {
    *why = "past this process's " + std::to_string(count) +
           " CUDA device(s) (CUDA_VISIBLE_DEVICES selects and renumbers them)";
    return 1;
  }
  try {
    *out = new meshrun::train::cuda::CudaRankGpu(device);
    return 0;
  } catch (const std::exception& e) {
    *why = e.what();
    return 1;
  }
}

// The entry's type is the one the trainer expects.
static_assert(std::is_same_v<decltype(&meshrun_trainer_cuda_rank_gpu),
                             meshrun::train::meshrun_trainer_cuda_rank_gpu_fn>);
