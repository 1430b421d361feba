// The shipped Llama, GPT-2 and Mixtral plugins on a GPU through the model
// ABI, as the trainer will drive them: the core's ModelStage on cuda:0 with
// a stream (ABI 1.14's setup), the kit loading its GPU compute
// (libmeshrun_kit_cuda.so) from beside libmeshrun_kit.so, tokens, targets,
// parameters and gradients in device memory, against the same plugin's
// stage on the CPU from the same initial parameters: one micro-batch's
// loss and every gradient, float32 and under the plan's bfloat16 autocast.
// Then a device past the count is refused, naming it. Without a usable GPU
// it exits 77.
//
// Tolerances as tests/gpu/test_cuda_kit_stage.cpp states and justifies them
// for a kit stage (this is the same computation reached through the ABI):
// float32 1e-4 + 1e-3 |cpu|, bfloat16 2e-3 + 3e-2 |cpu|.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "plugin_stage.hpp"
#include "usable_devices.hpp"

namespace {

int failures = 0;

void check_plugin(const std::string& path, const nlohmann::ordered_json& config, bool bfloat16,
                  cudaStream_t stream) {
  const meshrun::Model model(meshrun::PluginLoader({}).load_file(path), config);
  const plugin_stage::Reference cpu = plugin_stage::cpu_reference(model, bfloat16);
  DeviceBuffer<float> device_values(cpu.initial),
      device_gradients(std::vector<float>(cpu.initial.size()));
  DeviceBuffer<int32_t> device_tokens(cpu.tokens), device_targets(cpu.targets);
  const double gpu_loss = plugin_stage::step(
      model, meshrun::StageDevice{DLDevice{kDLCUDA, 0}, stream}, cpu.plan, device_values.get(),
      device_gradients.get(), device_tokens.get(), device_targets.get());
  require(cudaStreamSynchronize(stream), "the stage's stream");

  const Bound bound = bfloat16 ? Bound{2e-3, 3e-2} : Bound{1e-4, 1e-3};
  const bool same = within<double>("loss", {gpu_loss}, {cpu.loss}, bound) &&
                    within("gradients", device_gradients.host(), cpu.gradients, bound);
  std::printf("%s %s on cuda:0 through the ABI as on the CPU, %s (loss %.7f, %.7f on the CPU)\n",
              same ? "PASS" : "FAIL", path.c_str(), bfloat16 ? "bfloat16" : "float32", gpu_loss,
              cpu.loss);
  if (!same) ++failures;
}

// A stage on the device past the count is refused, naming it.
void check_missing_device(const std::string& path, int devices) {
  const meshrun::Model model(meshrun::PluginLoader({}).load_file(path),
                             plugin_stage::llama_config());
  std::vector<float> values(size_t(model.description().numel));
  plugin_stage::FlatHooks hooks(model.description(), values.data(), nullptr);
  const std::string device = "cuda:" + std::to_string(devices);
  try {
    meshrun::ModelStage stage(model, plugin_stage::all_modules(model), hooks, {}, "{}", "{}",
                              nullptr, meshrun::StageDevice{DLDevice{kDLCUDA, devices}, nullptr});
    std::printf("FAIL %s: a stage on %s was made\n", path.c_str(), device.c_str());
    ++failures;
  } catch (const meshrun::Error& e) {
    const bool named =
        e.code() == MESHRUN_OUT_OF_RANGE && std::string(e.what()).find(device) != std::string::npos;
    std::printf("%s %s refuses %s: %s\n", named ? "PASS" : "FAIL", path.c_str(), device.c_str(),
                e.what());
    if (!named) ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s LLAMA_PLUGIN GPT2_PLUGIN MIXTRAL_PLUGIN\n", argv[0]);
    return 2;
  }
  const std::optional<int> devices = usable_cuda_devices();
  if (!devices) return kSkip;
  cudaStream_t stream = nullptr;
  require(cudaStreamCreate(&stream), "cudaStreamCreate");
  try {
    for (const bool bfloat16 : {false, true}) {
      check_plugin(argv[1], plugin_stage::llama_config(), bfloat16, stream);
      check_plugin(argv[2], plugin_stage::gpt2_config(), bfloat16, stream);
      check_plugin(argv[3], plugin_stage::mixtral_config(), bfloat16, stream);
    }
    check_missing_device(argv[1], *devices);
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    ++failures;
  }
  cudaStreamDestroy(stream);
  std::printf("%d of the model plugins' GPU checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
