// meshrun_run_train (abi/include/meshrun/host.h): the whole of `meshrun
// train` as one call a host makes in its own process, over the trainer;
// and the GEMM peak its mfu divides by, for hosts that train themselves.
#include <optional>
#include <string>

#include "gemm_peak/gemm_peak.hpp"
#include "host_api.hpp"
#include "meshrun/host.h"
#include "train/loop.hpp"
#include "train/run.hpp"

meshrun_error* meshrun_run_train(meshrun_runtime* runtime, const char* output_dir,
                                 meshrun_step_callback callback, void* context) {
  using meshrun::host_api::require;
  return meshrun::host_api::guarded(__func__, [&] {
    meshrun::host_api::live(runtime, "runtime");
    const auto& job = runtime->runtime.job();
    meshrun::train::StepObserver observer;
    if (callback != nullptr) {
      observer = [callback, context](const std::string& metrics_line) {
        return callback(context, metrics_line.c_str()) == 0;
      };
    }
    // A CUDA run's NCCL world, joined on the rank's GPU, carries the
    // trainer's state too (no second NCCL world for the training).
    meshrun::Communicator* gpu_world =
        &job->world() != &job->host_world() ? &job->world() : nullptr;
    try {
      meshrun::train::train_in_process(
          runtime->runtime.config(),
          output_dir != nullptr ? std::optional<std::string>(output_dir) : std::nullopt,
          meshrun::train::gemm_peak_meter(runtime->runtime.config().dist_env.on_cuda()),
          job->host_world(), observer, gpu_world);
    } catch (const meshrun::train::NonFiniteStep& stop) {
      throw meshrun::Error(MESHRUN_FAILED_PRECONDITION, stop.what());
    }
  });
}

meshrun_error* meshrun_gemm_peak_flops(const char* dtype, double seconds, double* out_flops_per_s) {
  using meshrun::host_api::require;
  return meshrun::host_api::guarded(__func__, [&] {
    require(dtype, "dtype");
    require(out_flops_per_s, "out_flops_per_s");
    const std::string name = dtype;
    if (name != "float32" && name != "bfloat16") {
      throw meshrun::Error(MESHRUN_INVALID_ARGUMENT,
                           "dtype '" + name + "': expected float32 or bfloat16");
    }
    if (!(seconds > 0)) throw meshrun::Error(MESHRUN_INVALID_ARGUMENT, "seconds must be > 0");
    *out_flops_per_s = meshrun::train::gemm_peak_meter()(name, seconds).flops_per_s;
  });
}
