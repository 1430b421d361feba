// The kit's models on a CUDA stage through the model ABI, proven on the
// CPU: the shipped Llama, GPT-2 and Mixtral plugins, driven as the trainer
// drives a stage (the core's ModelStage on "cuda:0" with a stream), load
// the kit's GPU compute from beside libmeshrun_kit.so, which here is the
// fenced stand-in (fenced_gpu_compute.cpp: the host's kernels on memory
// that faults outside the compute's calls); parameters, gradients, tokens
// and targets live in that memory. The loss and every gradient must equal
// the CPU stage's bit for bit (the same kernels), in float32 and under the
// plan's bfloat16 autocast (which the loaded library learns only through
// the precision the kit hands it); the kit must pass the setup's device
// and stream on, and a device past the count is refused naming it.
//
// ctest runs it with LD_LIBRARY_PATH at the stand-in's folder, whose
// libmeshrun_kit.so is a link to the real one.
#include <dlfcn.h>

#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "plugin_stage.hpp"

namespace {

// The stand-in's functions for the test's side of its memory.
class FencedGpu {
 public:
  FencedGpu() : library_(dlopen(FENCED_GPU_LIBRARY, RTLD_NOW | RTLD_LOCAL)) {
    if (library_ == nullptr) FAIL("dlopen " << FENCED_GPU_LIBRARY << ": " << dlerror());
    allocate = symbol<void* (*)(int64_t)>("fenced_gpu_allocate");
    release = symbol<void (*)(void*)>("fenced_gpu_release");
    copy = symbol<void (*)(void*, const void*, int64_t)>("fenced_gpu_copy");
    last_device = symbol<int32_t (*)()>("fenced_gpu_last_device");
    last_stream = symbol<void* (*)()>("fenced_gpu_last_stream");
    computes_made = symbol<int64_t (*)()>("fenced_gpu_computes_made");
  }
  FencedGpu(const FencedGpu&) = delete;
  FencedGpu& operator=(const FencedGpu&) = delete;

  void* (*allocate)(int64_t);
  void (*release)(void*);
  void (*copy)(void*, const void*, int64_t);
  int32_t (*last_device)();
  void* (*last_stream)();
  int64_t (*computes_made)();

 private:
  template <class Function>
  Function symbol(const char* name) {
    auto* found = reinterpret_cast<Function>(dlsym(library_, name));
    if (found == nullptr) FAIL(FENCED_GPU_LIBRARY << " has no " << name);
    return found;
  }
  void* library_;
};

// A host vector's copy in the stand-in's memory.
template <typename T>
class FencedArray {
 public:
  FencedArray(FencedGpu& gpu, const std::vector<T>& host)
      : gpu_(gpu),
        size_(host.size()),
        data_(static_cast<T*>(gpu.allocate(int64_t(size_ * sizeof(T))))) {
    gpu_.copy(data_, host.data(), int64_t(size_ * sizeof(T)));
  }
  ~FencedArray() { gpu_.release(data_); }
  FencedArray(const FencedArray&) = delete;
  FencedArray& operator=(const FencedArray&) = delete;
  T* get() { return data_; }
  std::vector<T> host() const {
    std::vector<T> values(size_);
    gpu_.copy(values.data(), data_, int64_t(size_ * sizeof(T)));
    return values;
  }

 private:
  FencedGpu& gpu_;
  size_t size_;
  T* data_;
};

meshrun::Model model_of(const char* path, const nlohmann::ordered_json& config) {
  return meshrun::Model(meshrun::PluginLoader({}).load_file(path), config);
}

}  // namespace

TEST_CASE(
    "kit device stage: the shipped models on a CUDA stage compute in the loaded compute's "
    "memory as on the CPU",
    "[kit][device]") {
  FencedGpu gpu;
  const auto [path, config] = GENERATE(
      std::pair<const char*, nlohmann::ordered_json>{LLAMA_PLUGIN, plugin_stage::llama_config()},
      std::pair<const char*, nlohmann::ordered_json>{GPT2_PLUGIN, plugin_stage::gpt2_config()},
      std::pair<const char*, nlohmann::ordered_json>{MIXTRAL_PLUGIN,
                                                     plugin_stage::mixtral_config()});
  const bool bfloat16 = GENERATE(false, true);
  CAPTURE(path, bfloat16);
  const meshrun::Model model = model_of(path, config);
  CHECK(model.description().devices == std::vector<std::string>{"cpu", "cuda"});
  const plugin_stage::Reference cpu = plugin_stage::cpu_reference(model, bfloat16);

  FencedArray<float> gpu_values(gpu, cpu.initial),
      gpu_gradients(gpu, std::vector<float>(cpu.initial.size()));
  FencedArray<int32_t> gpu_tokens(gpu, cpu.tokens), gpu_targets(gpu, cpu.targets);
  int stream_stand_in = 0;
  const int64_t made_before = gpu.computes_made();
  const double gpu_loss = plugin_stage::step(
      model, meshrun::StageDevice{DLDevice{kDLCUDA, 0}, &stream_stand_in}, cpu.plan,
      gpu_values.get(), gpu_gradients.get(), gpu_tokens.get(), gpu_targets.get());
  CHECK(gpu.computes_made() == made_before + 1);
  CHECK(gpu.last_device() == 0);
  CHECK(gpu.last_stream() == &stream_stand_in);
  CHECK(gpu_loss == cpu.loss);
  CHECK(gpu_gradients.host() == cpu.gradients);
  CHECK(gpu_values.host() == cpu.initial);
}

TEST_CASE("kit device stage: a device the loaded compute lacks is refused, naming it",
          "[kit][device]") {
  FencedGpu gpu;
  const meshrun::Model model = model_of(LLAMA_PLUGIN, plugin_stage::llama_config());
  std::vector<float> values(size_t(model.description().numel));
  plugin_stage::FlatHooks hooks(model.description(), values.data(), nullptr);
  try {
    meshrun::ModelStage stage(model, plugin_stage::all_modules(model), hooks, {}, "{}", "{}",
                              nullptr, meshrun::StageDevice{DLDevice{kDLCUDA, 3}, nullptr});
    FAIL("a stage on cuda:3 was made");
  } catch (const meshrun::Error& e) {
    CHECK(e.code() == MESHRUN_OUT_OF_RANGE);
    CHECK_THAT(e.what(), Catch::Contains("stage_create: cuda:3: cuda:3 is past this process's 1 "
                                         "CUDA device(s)"));
  }
  CHECK(gpu.last_device() == 3);
}
