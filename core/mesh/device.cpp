#include "mesh/device.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include "errors.hpp"
#include "launch/launch.hpp"

namespace meshrun {

namespace {

// The driver API's entry points meshrun asks (cuda.h's signatures; CUresult
// is an int, 0 success).
using CuInit = int (*)(unsigned int flags);
using CuDeviceGetCount = int (*)(int* count);
using CuGetErrorString = int (*)(int error, const char** text);

std::string driver_error(void* driver, int result) {
  const auto describe = reinterpret_cast<CuGetErrorString>(dlsym(driver, "cuGetErrorString"));
  const char* text = nullptr;
  if (describe != nullptr && describe(result, &text) == 0 && text != nullptr) return text;
  return fmt::format("CUresult {}", result);
}

}  // namespace

CudaDevices cuda_devices() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) return {0, "no NVIDIA driver: libcuda.so.1 cannot be loaded"};
  const auto init = reinterpret_cast<CuInit>(dlsym(driver, "cuInit"));
  const auto get_count = reinterpret_cast<CuDeviceGetCount>(dlsym(driver, "cuDeviceGetCount"));
  CudaDevices devices;
  if (init == nullptr || get_count == nullptr) {
    devices.why_none = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
  } else if (const int result = init(0); result != 0) {
    devices.why_none =
        "the NVIDIA driver does not start (cuInit: " + driver_error(driver, result) + ")";
  } else if (const int counted = get_count(&devices.count); counted != 0) {
    devices.count = 0;
    devices.why_none = "cuDeviceGetCount: " + driver_error(driver, counted);
  } else if (devices.count == 0) {
    devices.why_none = "the NVIDIA driver sees no device (CUDA_VISIBLE_DEVICES may hide them)";
  }
  dlclose(driver);
  return devices;
}

int32_t gpu_of_local_rank(int64_t local_rank, int count) {
  return static_cast<int32_t>(local_rank % count);
}

int32_t launched_rank_gpu(int64_t rank) {
  const CudaDevices devices = cuda_devices();
  if (devices.count == 0) {
    throw Error(MESHRUN_UNAVAILABLE,
                fmt::format("rank {}: dist_env.backend = \"nccl\" and this process sees no usable "
                            "CUDA device ({})",
                            rank, devices.why_none));
  }
  const auto launched = launch::detect_launcher();
  const int64_t local = launched && launched->local_rank ? *launched->local_rank : rank;
  return gpu_of_local_rank(local, devices.count);
}

void require_usable_devices(const Config& config, const CudaDevices& devices,
                            int64_t ranks_per_node) {
  if (!config.dist_env.on_cuda()) return;
  if (devices.count == 0) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                fmt::format("{}: dist_env.backend: \"nccl\" puts every rank on a CUDA GPU, and "
                            "this machine has none usable ({}); set it to \"gloo\" or \"mpi\" "
                            "to train on the CPU",
                            config.where("dist_env.backend"), devices.why_none),
                "dist_env.backend");
  }
  if (ranks_per_node <= devices.count) return;
  throw Error(MESHRUN_INVALID_ARGUMENT,
              fmt::format("--nproc-per-node: {} ranks a node, and this machine's processes see {} "
                          "CUDA GPU{}; dist_env.backend = \"nccl\" ({}) needs a GPU of its own "
                          "for each rank of a node (NCCL refuses two ranks on one GPU): start at "
                          "most {}, or let them see more (CUDA_VISIBLE_DEVICES)",
                          ranks_per_node, devices.count, devices.count == 1 ? "" : "s",
                          config.where("dist_env.backend"), devices.count),
              "--nproc-per-node");
}

}  // namespace meshrun
