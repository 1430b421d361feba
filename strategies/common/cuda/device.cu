// The sharding engine's buffers on a CUDA GPU (device.hpp): cudaMalloc'd
// memory, the casts as grid-stride kernels on the comm stream, the streams
// ordered with events. Compiled wherever the toolkit is; docs/testing.md
// says whether it has run on a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/device.hpp"
#include "meshrun/plugin.hpp"

namespace meshrun::strategies {
namespace {

using meshrun::plugin::Error;

constexpr int kThreads = 256;
constexpr int64_t kMostBlocks = 4096;

int blocks_for(int64_t count) {
  return static_cast<int>(std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, kMostBlocks));
}

// out[i] = round(in[i] * scale) to Out (round to nearest even, as the CPU's
// meshrun/dtype.hpp: identical bits for every finite value and infinity).
__device__ inline uint16_t to_bits(float value, Dtype dtype) {
  if (dtype == Dtype::bfloat16) return __bfloat16_as_ushort(__float2bfloat16_rn(value));
  return __half_as_ushort(__float2half_rn(value));
}
__device__ inline float from_bits(uint16_t bits, Dtype dtype) {
  if (dtype == Dtype::bfloat16) return __bfloat162float(__ushort_as_bfloat16(bits));
  return __half2float(__ushort_as_half(bits));
}

__global__ void narrow_kernel(Dtype dtype, const float* in, void* out, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float value = in[i] * scale;
    if (dtype == Dtype::float32) {
      static_cast<float*>(out)[i] = value;
    } else {
      static_cast<uint16_t*>(out)[i] = to_bits(value, dtype);
    }
  }
}

// out[i] = in[i] as float32, plus out[i] when `add`.
__global__ void widen_kernel(Dtype dtype, const void* in, float* out, int64_t count, bool add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float value = dtype == Dtype::float32
                            ? static_cast<const float*>(in)[i]
                            : from_bits(static_cast<const uint16_t*>(in)[i], dtype);
    out[i] = add ? out[i] + value : value;
  }
}

// *first = the least i with data[i] not finite (count when none).
__global__ void first_non_finite_kernel(const float* data, int64_t count,
                                        unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (!isfinite(data[i])) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

class CudaEvent final : public DeviceEvent {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int32_t device, cudaStream_t compute, cudaStream_t comm)
      : device_(device), compute_(compute), comm_(comm) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device < 0 || device >= count) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "setup: the tensors are on CUDA device " + std::to_string(device) +
                      ", but this process sees " + std::to_string(count) + " CUDA device(s)");
    }
    select();
    check(cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaMalloc(&first_, sizeof(unsigned long long)), "cudaMalloc");
  }
  ~CudaDevice() override {
    cudaFree(first_);
    cudaEventDestroy(comm_done_);
    cudaEventDestroy(compute_done_);
  }

  DLDevice where() const override { return {kDLCUDA, device_}; }
  bool orders_work_after_collectives() const override { return true; }

  std::byte* allocate(size_t bytes) override {
    select();
    void* data = nullptr;
    // A zero-byte buffer still needs an address: it is held.
    const cudaError_t status = cudaMalloc(&data, std::max<size_t>(bytes, 1));
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      throw Error(MESHRUN_UNAVAILABLE, "out of memory on CUDA device " + std::to_string(device_) +
                                           ": " + std::to_string(bytes) + " bytes asked for, " +
                                           std::to_string(free) + " of " + std::to_string(total) +
                                           " free");
    }
    check(status, "cudaMalloc");
    return static_cast<std::byte*>(data);
  }
  // cudaFree waits for the device: only reached when the engine goes.
  void free(std::byte* data) override { cudaFree(data); }

  void zero_for_compute(std::byte* data, size_t bytes, const DeviceEvent* last_use) override {
    select();
    compute_waits(last_use);
    check(cudaMemsetAsync(data, 0, bytes, compute_), "cudaMemsetAsync");
  }
  void copy(float* to, const float* from, int64_t count) override {
    select();
    check(cudaMemcpyAsync(to, from, size_t(count) * sizeof(float), cudaMemcpyDeviceToDevice, comm_),
          "cudaMemcpyAsync");
  }
  void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale) override {
    if (count == 0) return;
    select();
    narrow_kernel<<<blocks_for(count), kThreads, 0, comm_>>>(dtype, in, out, count, scale);
    check(cudaGetLastError(), "narrow kernel");
  }
  void widen(Dtype dtype, const void* in, float* out, int64_t count) override {
    launch_widen(dtype, in, out, count, false);
  }
  void widen_add(Dtype dtype, const void* in, float* out, int64_t count) override {
    launch_widen(dtype, in, out, count, true);
  }
  NonFinite first_non_finite(const float* data, int64_t count) override {
    if (count == 0) return {};
    select();
    const auto none = static_cast<unsigned long long>(count);
    check(cudaMemcpyAsync(first_, &none, sizeof none, cudaMemcpyHostToDevice, comm_),
          "cudaMemcpyAsync");
    first_non_finite_kernel<<<blocks_for(count), kThreads, 0, comm_>>>(data, count, first_);
    check(cudaGetLastError(), "first_non_finite kernel");
    unsigned long long first = none;
    check(cudaMemcpyAsync(&first, first_, sizeof first, cudaMemcpyDeviceToHost, comm_),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(comm_), "cudaStreamSynchronize");
    if (first == none) return {};
    NonFinite found{static_cast<int64_t>(first), 0.0f};
    check(cudaMemcpy(&found.value, data + first, sizeof(float), cudaMemcpyDeviceToHost),
          "cudaMemcpy");
    return found;
  }

  void comm_follows_compute() override { order(comm_, compute_, compute_done_); }
  void compute_follows_comm() override { order(compute_, comm_, comm_done_); }
  EventRef record() override {
    select();
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
    auto owned = std::make_shared<const CudaEvent>(event);
    check(cudaEventRecord(event, comm_), "cudaEventRecord");
    return owned;
  }
  void compute_waits(const DeviceEvent* event) override {
    if (event == nullptr) return;
    check(cudaStreamWaitEvent(compute_, static_cast<const CudaEvent*>(event)->get(), 0),
          "cudaStreamWaitEvent");
  }

 private:
  void select() const { check(cudaSetDevice(device_), "cudaSetDevice"); }

  void check(cudaError_t status, const char* call) const {
    if (status == cudaSuccess) return;
    cudaGetLastError();
    throw Error(MESHRUN_INTERNAL, "CUDA device " + std::to_string(device_) + ": " + call +
                                      " failed: " + cudaGetErrorString(status));
  }

  void launch_widen(Dtype dtype, const void* in, float* out, int64_t count, bool add) {
    if (count == 0) return;
    select();
    widen_kernel<<<blocks_for(count), kThreads, 0, comm_>>>(dtype, in, out, count, add);
    check(cudaGetLastError(), "widen kernel");
  }

  // `waiter`'s work from now on follows `leader`'s enqueued so far. One
  // event per direction suffices: a wait takes the event as it was recorded
  // when the wait is enqueued.
  void order(cudaStream_t waiter, cudaStream_t leader, cudaEvent_t event) {
    if (waiter == leader) return;
    select();
    check(cudaEventRecord(event, leader), "cudaEventRecord");
    check(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent");
  }

  int32_t device_;
  cudaStream_t compute_;
  cudaStream_t comm_;
  cudaEvent_t compute_done_ = nullptr;
  cudaEvent_t comm_done_ = nullptr;
  unsigned long long* first_ = nullptr;  // first_non_finite's result
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int32_t device_id, void* compute_stream,
                                         void* comm_stream) {
  return std::make_unique<CudaDevice>(device_id, static_cast<cudaStream_t>(compute_stream),
                                      static_cast<cudaStream_t>(comm_stream));
}

}  // namespace meshrun::strategies
