// Where a rank's training state lives and how the trainer computes on it:
// the parameters and gradients it updates, the AdamW moments, and the
// per-step arithmetic over them (zeroing, scaling, the gradient norm, the
// finiteness check, rounding to the storage dtype, the AdamW update). The
// host's memory (host_state_device(): the loops of state/optimizer.hpp and
// state/local_parameters.hpp), or a GPU's (trainer/cuda/state_device.hpp),
// one interface, so that the trainer's step is one code on either, and the
// host's is the GPU's oracle (tests/gpu/test_cuda_state_device.cpp).
//
// Pointers are of the device's memory. A GPU's calls are enqueued on its
// stream in call order and return without waiting, except those that hand
// a value to the host (the norm, the finiteness check, the copies to the
// host), which wait for it. The host's calls throw nothing but an
// allocation's std::runtime_error naming the bytes asked for; a GPU's throw
// std::runtime_error naming the call and the CUDA error (an out-of-memory
// naming the device and the bytes asked for).
//
// Kept to C++17: nvcc compiles the GPU's against it.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#include "state/adamw_update.hpp"

namespace meshrun {

class StateDevice {
 public:
  virtual ~StateDevice() = default;

  // The DLPack device of its memory, and the stream (a cudaStream_t; NULL
  // on the host) its calls are ordered on, which a model stage computing on
  // the state is handed too.
  virtual DLDevice where() const = 0;
  virtual void* stream() const = 0;

  // `bytes` of zeroed memory (NULL for 0).
  virtual void* allocate(int64_t bytes) = 0;
  // Memory allocate() returned, after the work enqueued on it (NULL: none).
  virtual void release(void* memory) noexcept = 0;
  virtual void copy_from_host(void* to, const void* from, int64_t bytes) = 0;
  virtual void copy_to_host(void* to, const void* from, int64_t bytes) = 0;

  // values[0, count) = 0.
  virtual void zero(float* values, int64_t count) = 0;
  // values[i] *= factor.
  virtual void scale(float* values, int64_t count, float factor) = 0;
  // sum values[i]^2, summed in double.
  virtual double squared_norm(const float* values, int64_t count) = 0;
  // Whether every value is finite.
  virtual bool all_finite(const float* values, int64_t count) = 0;
  // Rounds each value to `dtype` ("bfloat16" or "float16" to nearest even;
  // "float32" leaves them), kept as float32.
  virtual void round_to(float* values, int64_t count, const std::string& dtype) = 0;
  // One AdamW update of `count` elements (state/adamw_update.hpp);
  // decay[i] != 0 where element i gets weight decay.
  virtual void adamw(float* parameters, float* exp_avg, float* exp_avg_sq, const float* gradients,
                     const uint8_t* decay, int64_t count, const AdamWConstants& constants) = 0;
};

// The host's memory and loops. One for the process.
StateDevice& host_state_device();

// `count` floats of `device`'s memory where the host can read and write
// them: in place when that memory is the host's, else a copy in host
// memory, which write_back() copies to the device.
class HostView {
 public:
  HostView(StateDevice& device, float* values, int64_t count);
  float* data() { return data_; }
  void write_back();

 private:
  StateDevice& device_;
  float* values_;
  int64_t count_;
  std::vector<float> copy_;
  float* data_;
};

// An array of `count` elements in a state device's memory, zeroed, freed
// with it. Move-only; element access only through the device's calls.
template <class T>
class StateArray {
 public:
  StateArray() = default;
  StateArray(int64_t count, StateDevice& device)
      : device_(&device),
        data_(static_cast<T*>(device.allocate(count * int64_t(sizeof(T))))),
        count_(count) {}
  ~StateArray() {
    if (device_ != nullptr) device_->release(data_);
  }
  StateArray(StateArray&& other) noexcept { swap(other); }
  StateArray& operator=(StateArray&& other) noexcept {
    StateArray taken(std::move(other));
    swap(taken);
    return *this;
  }
  StateArray(const StateArray&) = delete;
  StateArray& operator=(const StateArray&) = delete;

  T* data() const { return data_; }
  int64_t size() const { return count_; }

 private:
  void swap(StateArray& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
  }

  StateDevice* device_ = nullptr;
  T* data_ = nullptr;
  int64_t count_ = 0;
};

}  // namespace meshrun
