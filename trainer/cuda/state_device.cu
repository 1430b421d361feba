// trainer/cuda/state_device.hpp. The norm sums in double in a fixed order
// (each of kNormBlocks blocks a fixed stride of the values, then a tree in
// shared memory, then the host over the blocks' sums), so that a run gives
// the same norm every time; it differs from the host's eight-lane sum only
// in the last bits of a double.
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/adamw.hpp"
#include "cuda/state_device.hpp"

namespace meshrun::train::cuda {

namespace {

constexpr int kBlock = 256;
constexpr int kNormBlocks = 256;

int blocks_for(int64_t count) {
  return int(std::min<int64_t>((count + kBlock - 1) / kBlock, int64_t(1) << 20));
}

__global__ void scale_kernel(float* values, int64_t count, float factor) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    values[i] *= factor;
  }
}

// partial[b] = sum of values[i]^2 over block b's elements (i = b * kBlock +
// thread, stepping by the grid).
__global__ void squared_norm_kernel(const float* values, int64_t count, double* partial) {
  __shared__ double sums[kBlock];
  double sum = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    sum += double(values[i]) * double(values[i]);
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kBlock / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// *nonfinite = 1 when a value is NaN or infinite (else left 0).
__global__ void nonfinite_kernel(const float* values, int64_t count, int* nonfinite) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (!isfinite(values[i])) *nonfinite = 1;
  }
}

// Round to nearest even, on the bits as meshrun/dtype.hpp's
// bfloat16_rounded_bits does (a NaN stays a quiet NaN).
__global__ void round_bfloat16_kernel(float* values, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const unsigned bits = __float_as_uint(values[i]);
    const unsigned rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const unsigned quiet_nan = (bits | 0x00400000u) & 0xffff0000u;
    values[i] = __uint_as_float((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

__global__ void round_float16_kernel(float* values, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    values[i] = __half2float(__float2half_rn(values[i]));
  }
}

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("cuda state device: ") + call + ": " +
                             cudaGetErrorString(status));
  }
}

class CudaStateDevice : public StateDevice {
 public:
  CudaStateDevice(int device, cudaStream_t stream) : device_(device), stream_(stream) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaMalloc(&partial_, kNormBlocks * sizeof(double)), "cudaMalloc (norm scratch)");
    check(cudaMalloc(&flag_, sizeof(int)), "cudaMalloc (finiteness flag)");
  }
  ~CudaStateDevice() override {
    cudaFree(partial_);
    cudaFree(flag_);
  }

  DLDevice where() const override { return DLDevice{kDLCUDA, device_}; }
  void* stream() const override { return stream_; }
  void* allocate(int64_t bytes) override {
    if (bytes == 0) return nullptr;
    void* memory = nullptr;
    const cudaError_t status = cudaMallocAsync(&memory, size_t(bytes), stream_);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      throw std::runtime_error("cuda state device: out of memory on CUDA device " +
                               std::to_string(device_) + ": " + std::to_string(bytes) +
                               " bytes asked for, " + std::to_string(free) + " of " +
                               std::to_string(total) + " free");
    }
    check(status, "cudaMallocAsync");
    check(cudaMemsetAsync(memory, 0, size_t(bytes), stream_), "allocate's zeroing");
    return memory;
  }
  void release(void* memory) noexcept override {
    if (memory != nullptr) cudaFreeAsync(memory, stream_);
  }
  void copy_from_host(void* to, const void* from, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(to, from, size_t(bytes), cudaMemcpyHostToDevice, stream_),
          "copy_from_host");
    // The host's buffer may be reused once the call returns.
    check(cudaStreamSynchronize(stream_), "copy_from_host");
  }
  void copy_to_host(void* to, const void* from, int64_t bytes) override {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(to, from, size_t(bytes), cudaMemcpyDeviceToHost, stream_),
          "copy_to_host");
    check(cudaStreamSynchronize(stream_), "copy_to_host");
  }
  void zero(float* values, int64_t count) override {
    if (count == 0) return;
    check(cudaMemsetAsync(values, 0, size_t(count) * sizeof(float), stream_), "zero");
  }
  void scale(float* values, int64_t count, float factor) override {
    if (count == 0) return;
    scale_kernel<<<blocks_for(count), kBlock, 0, stream_>>>(values, count, factor);
    check(cudaGetLastError(), "scale");
  }
  double squared_norm(const float* values, int64_t count) override {
    if (count == 0) return 0.0;
    squared_norm_kernel<<<kNormBlocks, kBlock, 0, stream_>>>(values, count, partial_);
    check(cudaGetLastError(), "squared_norm");
    double partial[kNormBlocks];
    copy_to_host(partial, partial_, int64_t(sizeof partial));
    double sum = 0;
    for (const double block : partial) sum += block;
    return sum;
  }
  bool all_finite(const float* values, int64_t count) override {
    if (count == 0) return true;
    check(cudaMemsetAsync(flag_, 0, sizeof(int), stream_), "all_finite");
    nonfinite_kernel<<<blocks_for(count), kBlock, 0, stream_>>>(values, count, flag_);
    check(cudaGetLastError(), "all_finite");
    int nonfinite = 0;
    copy_to_host(&nonfinite, flag_, int64_t(sizeof nonfinite));
    return nonfinite == 0;
  }
  void round_to(float* values, int64_t count, const std::string& dtype) override {
    if (count == 0) return;
    if (dtype == "bfloat16") {
      round_bfloat16_kernel<<<blocks_for(count), kBlock, 0, stream_>>>(values, count);
    } else if (dtype == "float16") {
      round_float16_kernel<<<blocks_for(count), kBlock, 0, stream_>>>(values, count);
    } else {
      return;
    }
    check(cudaGetLastError(), "round_to");
  }
  void adamw(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
             const uint8_t* decay, int64_t count, const AdamWConstants& constants) override {
    check(adamw_step(parameters, exp_avg, exp_avg_sq, gradients, decay, count, constants, stream_),
          "adamw");
  }

 private:
  int device_;
  cudaStream_t stream_;
  double* partial_ = nullptr;
  int* flag_ = nullptr;
};

}  // namespace

std::unique_ptr<StateDevice> make_state_device(int device, cudaStream_t stream) {
  return std::make_unique<CudaStateDevice>(device, stream);
}

}  // namespace meshrun::train::cuda
