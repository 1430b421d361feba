// The strategies with their buffers on a CUDA GPU over the nccl backend,
// against the same strategies in host memory over the mpi backend (their
// CPU twins), run by ctest through mpirun on 1 rank (and on 2 where a node
// has 2 GPUs):
//
//   mpirun -np 1 meshrun_strategy_device_test
//
// Each rank runs each script twice, through the core's Strategy wrapper: on
// the host (float vectors, the mpi world; on 1 rank the loopback test
// backend, so that a GPU machine without MPI runs it) and on its GPU
// (cudaMalloc'd buffers, the nccl world bootstrapped through the CPU one,
// the host's compute on one stream and the communicators on another, as
// ABI 1.13 describes).
//
// fsdp2: setup from rank 0's weights, broadcast_parameters, two steps of two
// micro-batches (the first deferred), the hooks around every unit as a
// trainer calls them, the host adding rank-, step- and micro-batch-dependent
// gradients through the unit views, an SGD step on the local shard, then
// gather_parameters. Every view the host reads (float32 and bfloat16
// parameters of every unit at every pre_ hook), the local shard's gradients
// after every step and the gathered parameters must be equal bit for bit,
// for float32 and bfloat16 gathers, float32 and bfloat16 reductions,
// deferred and immediate reduction, units kept gathered after forward, and
// no prefetch.
//
// ddp: broadcast_parameters from rank 0, then two steps of two micro-batches
// in which the host adds its gradients parameter by parameter, last to
// first, reporting each ready as a backward would, with buckets small enough
// that several all-reduces are in flight; the parameters after the
// broadcast and the gradients after every step must be equal bit for bit.
//
// Why bit for bit: on 1 or 2 ranks every reduction adds at most two values,
// once, and averaging divides by 1 or 2 (exact), so NCCL's order and MPI's
// cannot differ; the casts round to nearest even on both sides, and the
// device adds the reductions into the shard in the same order as the host.
// On more ranks the test refuses to run (NCCL's reduction order is its own).
//
// Without a usable CUDA device, or with fewer devices on the node than
// ranks on it, it exits 77 (skipped) saying why.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/bootstrap.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "fsdp2_setup.hpp"
#include "plugin/loader.hpp"
#include "strategy/strategy.hpp"
#include "usable_devices.hpp"

namespace {

using Json = nlohmann::json;
using meshrun::Communicator;

constexpr double kTimeoutSeconds = 120.0;

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// A layer stack with an embedding and head in the root (unit 3), sizes that
// 2 ranks do not divide, a scalar and a one-row parameter.
using meshrun::test::Parameter;
constexpr int32_t kUnits = 4;
constexpr int32_t kRoot = 3;
const std::vector<int32_t> kLayers = {0, 1, 2};
const std::vector<Parameter> kParameters = {
    {"model.embed_tokens.weight", 9, 7, kRoot},
    {"model.layers.0.self_attn.q_proj.weight", 7, 5, 0},
    {"model.layers.0.input_layernorm.weight", 1, 5, 0},
    {"model.layers.1.mlp.up_proj.weight", 11, 3, 1},
    {"model.layers.1.post_attention_layernorm.weight", 1, 1, 1},
    {"model.layers.2.mlp.down_proj.weight", 3, 11, 2},
    {"model.norm.weight", 7, 1, kRoot},
    {"lm_head.weight", 9, 7, kRoot},
};

// Not representable in 16 bits, so that rounding shows.
float initial_weight(int64_t i) { return 0.41f * float(i % 23) - 4.3f + 0.0117f * float(i); }

// Rank `rank`'s gradient of element i of a unit in micro-batch m of step s.
float local_gradient(int64_t rank, int step, int m, int64_t i) {
  return 0.5f + 0.0131f * float((rank + 1) * (m + 1) + step) + 0.0029f * float(i % 19);
}

// Where the script's buffers live: host memory, or a GPU reached through
// the host's compute stream.
class Memory {
 public:
  explicit Memory(cudaStream_t compute) : compute_(compute) {}
  virtual ~Memory() = default;
  virtual float* allocate(const std::vector<float>& values) = 0;
  virtual void free(float* data) = 0;
  virtual std::vector<float> read(const void* data, size_t bytes) = 0;
  virtual void write(void* data, const void* values, size_t bytes) = 0;

  std::vector<float> floats(const float* data, int64_t numel) {
    return read(data, size_t(numel) * sizeof(float));
  }
  // The bits of `numel` bfloat16 elements, two to a float (the last
  // float's upper half zero when numel is odd).
  std::vector<float> bfloat16s(const uint16_t* data, int64_t numel) {
    return read(data, size_t(numel) * sizeof(uint16_t));
  }
  void put(float* data, const std::vector<float>& values) {
    write(data, values.data(), values.size() * sizeof(float));
  }

 protected:
  cudaStream_t compute_;
};

class HostMemory final : public Memory {
 public:
  HostMemory() : Memory(nullptr) {}
  float* allocate(const std::vector<float>& values) override {
    auto* data = new float[values.size()];
    std::copy(values.begin(), values.end(), data);
    return data;
  }
  void free(float* data) override { delete[] data; }
  std::vector<float> read(const void* data, size_t bytes) override {
    std::vector<float> out((bytes + sizeof(float) - 1) / sizeof(float), 0.0f);
    std::memcpy(out.data(), data, bytes);
    return out;
  }
  void write(void* data, const void* values, size_t bytes) override {
    std::memcpy(data, values, bytes);
  }
};

// Reads and writes are ordered on the compute stream, as the host's
// kernels would be: that is the stream the strategy orders its work with.
class DeviceMemory final : public Memory {
 public:
  using Memory::Memory;
  float* allocate(const std::vector<float>& values) override {
    void* data = nullptr;
    check_cuda(cudaMalloc(&data, std::max<size_t>(values.size(), 1) * sizeof(float)), "cudaMalloc");
    put(static_cast<float*>(data), values);
    return static_cast<float*>(data);
  }
  void free(float* data) override { cudaFree(data); }
  std::vector<float> read(const void* data, size_t bytes) override {
    std::vector<float> out((bytes + sizeof(float) - 1) / sizeof(float), 0.0f);
    check_cuda(cudaMemcpyAsync(out.data(), data, bytes, cudaMemcpyDeviceToHost, compute_), "read");
    check_cuda(cudaStreamSynchronize(compute_), "read");
    return out;
  }
  void write(void* data, const void* values, size_t bytes) override {
    check_cuda(cudaMemcpyAsync(data, values, bytes, cudaMemcpyHostToDevice, compute_), "write");
    check_cuda(cudaStreamSynchronize(compute_), "write");
  }
};

// One side's job: its communicators (data-parallel = shard group = the
// world, replicate groups of one rank), memory and streams.
struct Side {
  const char* name;
  Communicator& world;
  Communicator& replicate;
  Memory& memory;
  DLDevice device;
  void* compute_stream;
  void* comm_stream;
};

// Everything the host saw, in order.
using Trace = std::vector<std::vector<float>>;

// The synthetic model on one side: its layout, and its weights (shifted by
// `shift`) and zero gradients in that side's memory.
struct ModelBuffers {
  ModelBuffers(const Side& side, float shift) : side(side) {
    offsets.push_back(0);
    for (const Parameter& p : kParameters) {
      offsets.push_back(offsets.back() + p.rows * p.columns);
      names.emplace_back(p.name);
    }
    std::vector<float> initial(static_cast<size_t>(numel()));
    for (size_t i = 0; i < initial.size(); ++i) initial[i] = initial_weight(int64_t(i)) + shift;
    weights = side.memory.allocate(initial);
    gradients = side.memory.allocate(std::vector<float>(initial.size(), 0.0f));
  }
  ~ModelBuffers() {
    side.memory.free(gradients);
    side.memory.free(weights);
  }
  ModelBuffers(const ModelBuffers&) = delete;
  ModelBuffers& operator=(const ModelBuffers&) = delete;

  int64_t numel() const { return offsets.back(); }
  meshrun::StrategyBuffers strategy_buffers() const {
    return {weights,     gradients,           numel(),         offsets, names,
            side.device, side.compute_stream, side.comm_stream};
  }

  const Side& side;
  std::vector<int64_t> offsets;
  std::vector<std::string> names;
  float* weights = nullptr;
  float* gradients = nullptr;
};

// The fsdp2 script (see the file's header).
class ShardedScript {
 public:
  ShardedScript(const Side& side, std::shared_ptr<meshrun::PluginLibrary> fsdp2,
                const std::string& options)
      : side_(side), model_(side, 0.0f) {
    meshrun::StrategyUnits units{&side.world, &side.replicate, kUnits, kRoot, {}, {}};
    for (const Parameter& p : kParameters) {
      units.parameter_units.push_back(p.unit);
      units.parameter_rows.push_back(p.rows);
    }
    strategy_ = std::make_unique<meshrun::Strategy>(std::move(fsdp2), side.world,
                                                    model_.strategy_buffers(), options, &units);
  }

  Trace run() {
    strategy_->broadcast_parameters();
    for (int step = 0; step < 2; ++step) {
      for (int m = 0; m < 2; ++m) micro_batch(step, m);
      strategy_->finish_gradients();
      sgd_step();
    }
    std::vector<float> full(size_t(model_.numel()), 0.0f);
    float* gathered = side_.memory.allocate(full);
    strategy_->gather_parameters(gathered, model_.numel());
    trace_.push_back(side_.memory.floats(gathered, model_.numel()));
    side_.memory.free(gathered);
    return trace_;
  }

 private:
  void micro_batch(int step, int m) {
    strategy_->begin_micro_batch(m == 1);
    strategy_->pre_forward(kRoot);
    record_views(kRoot);
    for (int32_t u : kLayers) {
      strategy_->pre_forward(u);
      record_views(u);
      strategy_->post_forward(u);
    }
    strategy_->post_forward(kRoot);
    strategy_->pre_backward(kRoot);
    add_gradients(kRoot, step, m);
    for (auto u = kLayers.rbegin(); u != kLayers.rend(); ++u) {
      strategy_->pre_backward(*u);
      record_views(*u);
      add_gradients(*u, step, m);
      strategy_->post_backward(*u);
    }
    strategy_->post_backward(kRoot);
  }

  void record_views(int32_t unit) {
    const meshrun::FloatView parameters = strategy_->unit_views(unit).first;
    trace_.push_back(side_.memory.floats(parameters.data, parameters.numel));
    const meshrun::Bfloat16View bfloat16 = strategy_->unit_views_bfloat16(unit);
    if (bfloat16.data != nullptr) {
      trace_.push_back(side_.memory.bfloat16s(bfloat16.data, bfloat16.numel));
    }
  }

  // The gradient view += this rank's gradients, read and written back as a
  // backward kernel accumulating into it would.
  void add_gradients(int32_t unit, int step, int m) {
    const meshrun::FloatView gradients = strategy_->unit_views(unit).second;
    std::vector<float> values = side_.memory.floats(gradients.data, gradients.numel);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] += local_gradient(side_.world.rank(), step, m, int64_t(i) + unit * 101);
    }
    side_.memory.put(gradients.data, values);
  }

  // parameters -= 0.25 * gradients on the local shard, whose gradients the
  // host then zeroes, as the trainer's optimizer does.
  void sgd_step() {
    const auto [parameters, gradients] = strategy_->local_shard();
    std::vector<float> p = side_.memory.floats(parameters.data, parameters.numel);
    std::vector<float> g = side_.memory.floats(gradients.data, gradients.numel);
    trace_.push_back(g);
    for (size_t i = 0; i < p.size(); ++i) p[i] -= 0.25f * g[i];
    side_.memory.put(parameters.data, p);
    side_.memory.put(gradients.data, std::vector<float>(g.size(), 0.0f));
  }

  const Side& side_;
  ModelBuffers model_;  // before the strategy: destroyed after it
  std::unique_ptr<meshrun::Strategy> strategy_;
  Trace trace_;
};

// The ddp script (see the file's header).
class ReplicatedScript {
 public:
  // Every rank starts from its own weights: the broadcast makes them rank 0's.
  ReplicatedScript(const Side& side, std::shared_ptr<meshrun::PluginLibrary> ddp)
      : side_(side), model_(side, float(side.world.rank())) {
    // 64-byte buckets: several all-reduces in flight in one backward.
    const Json options = {{"strategy", "ddp"}, {"bucket_cap_mb", 64.0 / (1024 * 1024)}};
    strategy_ = std::make_unique<meshrun::Strategy>(std::move(ddp), side.world,
                                                    model_.strategy_buffers(), options.dump());
  }

  Trace run() {
    strategy_->broadcast_parameters();
    trace_.push_back(side_.memory.floats(model_.weights, model_.numel()));
    for (int step = 0; step < 2; ++step) {
      side_.memory.put(model_.gradients, std::vector<float>(size_t(model_.numel()), 0.0f));
      for (int m = 0; m < 2; ++m) {
        strategy_->begin_micro_batch(m == 1);
        for (size_t p = kParameters.size(); p-- > 0;) add_gradients(p, step, m);
      }
      strategy_->finish_gradients();
      trace_.push_back(side_.memory.floats(model_.gradients, model_.numel()));
    }
    return trace_;
  }

 private:
  void add_gradients(size_t p, int step, int m) {
    const int64_t begin = model_.offsets[p];
    const int64_t end = model_.offsets[p + 1];
    std::vector<float> values = side_.memory.floats(model_.gradients + begin, end - begin);
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] += local_gradient(side_.world.rank(), step, m, begin + int64_t(i));
    }
    side_.memory.put(model_.gradients + begin, values);
    strategy_->gradients_ready(begin, end);
  }

  const Side& side_;
  ModelBuffers model_;  // before the strategy: destroyed after it
  std::unique_ptr<meshrun::Strategy> strategy_;
  Trace trace_;
};

// The first difference between two traces, or "" when equal bit for bit.
std::string first_difference(const Trace& host, const Trace& device) {
  if (host.size() != device.size()) {
    return "host saw " + std::to_string(host.size()) + " buffers, device " +
           std::to_string(device.size());
  }
  for (size_t b = 0; b < host.size(); ++b) {
    if (host[b].size() != device[b].size() ||
        std::memcmp(host[b].data(), device[b].data(), host[b].size() * sizeof(float)) != 0) {
      for (size_t i = 0; i < std::min(host[b].size(), device[b].size()); ++i) {
        if (std::memcmp(&host[b][i], &device[b][i], sizeof(float)) == 0) continue;
        return "buffer " + std::to_string(b) + " element " + std::to_string(i) + ": host " +
               std::to_string(host[b][i]) + ", device " + std::to_string(device[b][i]);
      }
      return "buffer " + std::to_string(b) + " has " + std::to_string(host[b].size()) +
             " elements on the host, " + std::to_string(device[b].size()) + " on the device";
    }
  }
  return "";
}

int run(int device, int ranks) {
  if (ranks > 2) throw std::runtime_error("run on 1 or 2 ranks (see the file's header)");
  const meshrun::PluginLoader loader = meshrun::PluginLoader::from_environment();
  const auto fsdp2 = loader.load(meshrun::PluginKind::strategy, "fsdp2");
  // One rank needs no MPI (the GPU machines have none): the loopback test
  // backend is its CPU twin's comm.
  meshrun::CommBackend cpu_backend(loader, ranks == 1 ? "loopback" : "mpi");
  Communicator cpu_world = cpu_backend.world(kTimeoutSeconds);
  Communicator cpu_replicate = cpu_world.split(cpu_world.rank(), 0, "dp_replicate");
  const meshrun::CommBootstrap bootstrap(cpu_world);
  meshrun::CommBackend nccl(loader, "nccl");
  Communicator gpu_world = nccl.world(kTimeoutSeconds, device, bootstrap.get());
  Communicator gpu_replicate = gpu_world.split(gpu_world.rank(), 0, "dp_replicate");
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  check_cuda(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreate");
  gpu_world.set_stream(comm);
  gpu_replicate.set_stream(comm);

  HostMemory host_memory;
  DeviceMemory device_memory(compute);
  const Side host{"host", cpu_world, cpu_replicate, host_memory, {kDLCPU, 0}, nullptr, nullptr};
  const Side gpu{"cuda", gpu_world, gpu_replicate, device_memory, {kDLCUDA, device}, compute, comm};

  int failures = 0;
  const auto compare = [&](const std::string& what, const Trace& expected, const Trace& got) {
    const std::string difference = first_difference(expected, got);
    if (difference.empty()) {
      std::printf("PASS rank %lld: %s: %zu buffers equal bit for bit\n",
                  static_cast<long long>(cpu_world.rank()), what.c_str(), got.size());
      return;
    }
    ++failures;
    std::fprintf(stderr, "FAIL rank %lld: %s: %s\n", static_cast<long long>(cpu_world.rank()),
                 what.c_str(), difference.c_str());
  };
  const auto ddp = loader.load(meshrun::PluginKind::strategy, "ddp");
  compare("ddp", ReplicatedScript(host, ddp).run(), ReplicatedScript(gpu, ddp).run());
  const std::vector<std::pair<const char*, Json>> cases = {
      {"float32 gathers and reductions", Json::object()},
      {"bfloat16 gathers", {{"mp_policy", {{"param_dtype", "bfloat16"}}}}},
      {"bfloat16 gathers and reductions, reduced every micro-batch",
       {{"mp_policy", {{"param_dtype", "bfloat16"}, {"reduce_dtype", "bfloat16"}}},
        {"defer_fsdp_grad_sync", false}}},
      {"units kept gathered after forward, one-deep backward prefetch",
       {{"reshard_after_forward", false}, {"fsdp2_backward_prefetch_depth", 1}}},
      {"no prefetch", {{"enable_fsdp2_prefetch", false}}},
  };
  for (const auto& [what, changes] : cases) {
    const std::string options = meshrun::test::fsdp2_options_with(changes);
    compare(std::string("fsdp2, ") + what, ShardedScript(host, fsdp2, options).run(),
            ShardedScript(gpu, fsdp2, options).run());
  }
  gpu_replicate.set_stream(nullptr);
  gpu_world.set_stream(nullptr);
  check_cuda(cudaStreamDestroy(comm), "cudaStreamDestroy");
  check_cuda(cudaStreamDestroy(compute), "cudaStreamDestroy");
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  const std::optional<int> usable = usable_cuda_devices();
  if (!usable) return kSkip;
  const int local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  const int local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  if (*usable < local_size) {
    std::printf("SKIP: %d ranks on this node but %d CUDA device(s); NCCL needs a device per rank\n",
                local_size, *usable);
    return kSkip;
  }
  try {
    return run(local_rank % *usable, env_int("OMPI_COMM_WORLD_SIZE", 1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strategy device test: %s\n", e.what());
    return 1;
  }
}
