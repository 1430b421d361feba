#include "kit/stage_compute.hpp"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>
#include <string>

#include "kit/cuda/entry.hpp"
#include "meshrun/model.hpp"
#include "numeric/gemm.hpp"

namespace meshrun::kit {

namespace {

// The directory libmeshrun_kit.so was loaded from.
std::filesystem::path kit_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&cuda_compute_installed), &info) == 0 ||
      info.dli_fname == nullptr) {
    return {};
  }
  return std::filesystem::path(info.dli_fname).parent_path();
}

std::filesystem::path cuda_library() { return kit_directory() / MESHRUN_KIT_CUDA_LIBRARY; }

// The library's entry, loaded once and kept for the process; throws
// plugin::Error (`on` names the device) when it is missing or unloadable.
meshrun_kit_cuda_compute_fn cuda_entry(const std::string& on) {
  static std::mutex mutex;
  static meshrun_kit_cuda_compute_fn entry = nullptr;
  const std::lock_guard<std::mutex> lock(mutex);
  if (entry != nullptr) return entry;
  const std::string path = cuda_library().string();
  if (!std::filesystem::exists(path)) {
    throw plugin::Error(MESHRUN_UNIMPLEMENTED,
                        "stage_create: the stage setup's device is " + on + ", and " + path +
                            " is missing: this build of the model kit computes on the CPU only "
                            "(it was built without the CUDA toolkit's cuBLASLt)");
  }
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    throw plugin::Error(MESHRUN_UNAVAILABLE,
                        "stage_create: " + on + ": " + path + " cannot be loaded: " + dlerror());
  }
  entry = reinterpret_cast<meshrun_kit_cuda_compute_fn>(dlsym(library, MESHRUN_KIT_CUDA_SYMBOL));
  if (entry == nullptr) {
    throw plugin::Error(MESHRUN_INTERNAL, "stage_create: " + path + " has no " +
                                              std::string(MESHRUN_KIT_CUDA_SYMBOL));
  }
  return entry;
}

}  // namespace

bool cuda_compute_installed() { return std::filesystem::exists(cuda_library()); }

std::unique_ptr<models::Compute> make_cuda_compute(DLDevice device, void* stream) {
  const std::string on = plugin::device_name(device);
  const meshrun_kit_cuda_compute_fn entry = cuda_entry(on);
  models::Compute* made = nullptr;
  std::string why;
  const int32_t code = entry(device.device_id, stream, &kernels::matmul_precision, &made, &why);
  if (code != MESHRUN_OK) throw plugin::Error(code, "stage_create: " + on + ": " + why);
  return std::unique_ptr<models::Compute>(made);
}

}  // namespace meshrun::kit
