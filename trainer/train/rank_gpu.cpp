#include "train/rank_gpu.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <mutex>

#include "errors.hpp"
#include "plugin/loader.hpp"

namespace meshrun::train {
namespace {

// The library's entry, loaded once and kept for the process.
meshrun_trainer_cuda_rank_gpu_fn rank_gpu_entry(const std::string& on) {
  static std::mutex mutex;
  static meshrun_trainer_cuda_rank_gpu_fn entry = nullptr;
  const std::lock_guard<std::mutex> lock(mutex);
  if (entry != nullptr) return entry;
  const std::string path = library_folder_file(MESHRUN_TRAINER_CUDA_LIBRARY);
  if (!std::filesystem::exists(path)) {
    throw Error(MESHRUN_UNAVAILABLE,
                fmt::format("{}: {} is missing: this build trains on the CPU only (it was built "
                            "without the CUDA toolkit)",
                            on, path));
  }
  entry = reinterpret_cast<meshrun_trainer_cuda_rank_gpu_fn>(
      load_library_symbol(path, MESHRUN_TRAINER_CUDA_SYMBOL, on, MESHRUN_UNAVAILABLE));
  return entry;
}

}  // namespace

std::unique_ptr<RankGpu> open_rank_gpu(int32_t device, int64_t rank) {
  const std::string on = fmt::format("rank {} on cuda:{}", rank, device);
  RankGpu* gpu = nullptr;
  std::string why;
  if (rank_gpu_entry(on)(device, &gpu, &why) != 0) {
    throw Error(MESHRUN_UNAVAILABLE, fmt::format("{}: {}", on, why));
  }
  return std::unique_ptr<RankGpu>(gpu);
}

}  // namespace meshrun::train
