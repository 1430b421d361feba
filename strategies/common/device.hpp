// Where a strategy's buffers live and how it computes on them: host memory,
// or a CUDA GPU's (cuda/device.cu). The sharding engine touches buffer
// memory only through this interface, so one engine serves both; ddp uses
// its stream ordering only (its buckets are the host's gradients).
//
// A GPU device has two streams (meshrun/strategy.h, ABI 1.13): the host's
// compute stream, and the comm stream the collectives run on. A strategy's
// own kernels (casts, copies) run on the comm stream, except the zeroing of
// a buffer the host's compute writes. Events order one stream after the
// other; the host never waits for them. The host device has no streams:
// every call completes before it returns, and the ordering calls do
// nothing.
//
// Header kept to C++17: nvcc compiles the CUDA implementation against it.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "meshrun/strategy.h"
#include "precision.hpp"

namespace meshrun::strategies {

// A point in the comm stream's work: what follows a wait on it runs after
// the comm work enqueued before it was recorded. Owned by shared_ptr, so
// that every buffer a collective used can carry the collective's event.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
};
using EventRef = std::shared_ptr<const DeviceEvent>;

// A non-finite element found in a buffer: its index, and its value.
struct NonFinite {
  int64_t index = -1;  // -1: every element is finite
  float value = 0.0f;
};

class Device {
 public:
  virtual ~Device() = default;

  // The DLPack device of the engine's buffers (kDLCPU, or kDLCUDA and the
  // GPU's ordinal).
  virtual DLDevice where() const = 0;
  // True when work enqueued after a collective is ordered after it without
  // the host waiting (a CUDA stream); false when the host must wait for a
  // collective before using its result (host memory).
  virtual bool orders_work_after_collectives() const = 0;

  // `bytes` bytes of the device's memory, contents undefined. Throws
  // UNAVAILABLE naming the device and the bytes when it has no more.
  virtual std::byte* allocate(size_t bytes) = 0;
  // Returns memory allocate() gave, after every use of it (NULL: nothing).
  virtual void free(std::byte* data) = 0;

  // Zeroes `bytes` at `data` for the host's compute, after the comm work
  // `last_use` marks (NULL: nothing to wait for).
  virtual void zero_for_compute(std::byte* data, size_t bytes, const DeviceEvent* last_use) = 0;
  // On the comm stream: to[i] = from[i] for `count` floats.
  virtual void copy(float* to, const float* from, int64_t count) = 0;
  // On the comm stream, as precision.hpp's functions of the same names.
  virtual void narrow(Dtype dtype, const float* in, void* out, int64_t count, float scale) = 0;
  virtual void widen(Dtype dtype, const void* in, float* out, int64_t count) = 0;
  virtual void widen_add(Dtype dtype, const void* in, float* out, int64_t count) = 0;
  // The first element of data[0, count) that is not finite, after the comm
  // work enqueued so far (the host waits for it: a check, not a hot path).
  virtual NonFinite first_non_finite(const float* data, int64_t count) = 0;

  // The comm stream's work from now on follows the host's compute enqueued
  // so far.
  virtual void comm_follows_compute() = 0;
  // The host's compute from now on follows the comm work enqueued so far.
  virtual void compute_follows_comm() = 0;
  // An event at the comm stream's current end; NULL on the host.
  virtual EventRef record() = 0;
  // The host's compute from now on follows `event` (NULL: nothing).
  virtual void compute_waits(const DeviceEvent* event) = 0;
};

// Host memory: precision.hpp's loops, memcpy, memset.
std::unique_ptr<Device> make_host_device();

// The device of `setup`'s comm backend: for kDLCUDA the GPU of the setup's
// tensors and the streams of ABI 1.13 (a smaller setup: the default stream
// for both), for any other type the host device (whose ordering does
// nothing). Errors as make_cuda_device's.
std::unique_ptr<Device> make_device(const meshrun_strategy_setup& setup);

// The CUDA GPU `device_id`, its compute and comm streams (cudaStream_t; NULL
// is the legacy default stream). Throws UNIMPLEMENTED when the strategy was
// built without the CUDA toolkit, and INVALID_ARGUMENT for a device id past
// the GPUs the process sees.
std::unique_ptr<Device> make_cuda_device(int32_t device_id, void* compute_stream,
                                         void* comm_stream);

}  // namespace meshrun::strategies
