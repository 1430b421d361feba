// The host API's strategies (meshrun/host.h, ABI 1.5): the configured
// strategy plugin over the caller's flat parameter and gradient buffers, on
// the data-parallel communicators of the joined job, its hooks, its local
// shard for the caller's optimizer, and checkpoints in meshrun train's format.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <vector>

#include "host_api.hpp"
#include "state/checkpoint.hpp"
#include "state/local_parameters.hpp"
#include "state/optimizer.hpp"
#include "strategy/strategy.hpp"

struct meshrun_strategy {
  std::shared_ptr<meshrun::Job> job;  // first: outlives the strategy
  meshrun::StrategyUnits units;
  std::vector<int64_t> offsets;  // num_parameters + 1
  std::unique_ptr<meshrun::Strategy> strategy;
  meshrun::LocalParameters local;
  meshrun::CheckpointLayout layout;
  int64_t seed = 0;
  DLDevice device{kDLCPU, 0};  // of the buffers and every view
  // The shape arrays of the views handed out (DLTensor points at them).
  std::vector<std::array<int64_t, 2>> unit_shapes;
  int64_t local_shape = 0;
};

namespace {

using meshrun::Error;
using meshrun::host_api::adopt;
using meshrun::host_api::guarded;
using meshrun::host_api::live;
using meshrun::host_api::require;

[[noreturn]] void bad_parameters(const std::string& what) {
  throw Error(MESHRUN_INVALID_ARGUMENT, "meshrun_strategy_parameters: " + what);
}

std::string device_name(DLDevice device) {
  return device.device_type == kDLCPU
             ? "the CPU"
             : fmt::format("device type {} id {}", int(device.device_type), device.device_id);
}

// A caller's flat float32 buffer of `numel` elements on `device`, or
// INVALID_ARGUMENT naming `name` ("params->parameters", "full").
float* flat_float32(const DLTensor& tensor, int64_t numel, const std::string& name,
                    DLDevice device = {kDLCPU, 0}) {
  const auto refuse = [&](const std::string& why) {
    throw Error(MESHRUN_INVALID_ARGUMENT, fmt::format("{}: {}", name, why));
  };
  if (tensor.data == nullptr) refuse("data is NULL");
  if (tensor.ndim < 0) refuse(fmt::format("ndim {} is negative", tensor.ndim));
  if (tensor.ndim > 0 && tensor.shape == nullptr) refuse("shape is NULL");
  int64_t elements = 1;
  for (int32_t d = 0; d < tensor.ndim; ++d) elements *= tensor.shape[d];
  const bool compact = tensor.strides == nullptr || (tensor.ndim == 1 && tensor.strides[0] == 1);
  if (tensor.device.device_type != device.device_type ||
      (device.device_type != kDLCPU && tensor.device.device_id != device.device_id)) {
    refuse(fmt::format("is on {}, but the runtime's buffers are on {} (the comm backend's device)",
                       device_name(tensor.device), device_name(device)));
  }
  if (tensor.dtype.code != kDLFloat || tensor.dtype.bits != 32 || tensor.dtype.lanes != 1 ||
      !compact || elements != numel) {
    refuse(
        fmt::format("must be a compact float32 tensor of {} elements (every parameter), "
                    "got {} elements",
                    numel, elements));
  }
  return reinterpret_cast<float*>(static_cast<std::byte*>(tensor.data) + tensor.byte_offset);
}

// Checks the description and returns the parameter offsets.
std::vector<int64_t> checked_offsets(const meshrun_strategy_parameters& p) {
  if (p.struct_size < MESHRUN_STRUCT_SIZE(meshrun_strategy_parameters, extensions)) {
    bad_parameters(
        fmt::format("struct_size {} is smaller than its ABI 1.5 layout ({} bytes): set it to "
                    "sizeof(meshrun_strategy_parameters)",
                    p.struct_size, MESHRUN_STRUCT_SIZE(meshrun_strategy_parameters, extensions)));
  }
  if (p.num_parameters < 1) bad_parameters("num_parameters must be >= 1");
  require(p.names, "params->names");
  require(p.numels, "params->numels");
  require(p.rows, "params->rows");
  require(p.units, "params->units");
  if (p.num_units < 1 || p.root_unit < 0 || p.root_unit >= p.num_units) {
    bad_parameters(
        fmt::format("root_unit {} must be in [0, num_units {})", p.root_unit, p.num_units));
  }
  std::vector<int64_t> offsets{0};
  for (int64_t i = 0; i < p.num_parameters; ++i) {
    if (p.names[i] == nullptr) bad_parameters(fmt::format("names[{}] is NULL", i));
    if (p.numels[i] < 1 || p.rows[i] < 1 || p.numels[i] % p.rows[i] != 0) {
      bad_parameters(
          fmt::format("parameter {} ('{}'): numels {} must be >= 1 and a multiple of "
                      "rows {}",
                      i, p.names[i], p.numels[i], p.rows[i]));
    }
    if (p.units[i] < 0 || p.units[i] >= p.num_units) {
      bad_parameters(fmt::format("parameter {} ('{}'): unit {} is outside [0, num_units {})", i,
                                 p.names[i], p.units[i], p.num_units));
    }
    offsets.push_back(offsets.back() + p.numels[i]);
  }
  return offsets;
}

meshrun::CheckpointLayout layout_of(const meshrun_strategy_parameters& p) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0; i < p.num_parameters; ++i) {
    names.emplace_back(p.names[i]);
    shapes.push_back({p.numels[i]});
  }
  return meshrun::checkpoint_layout("host", names, shapes);
}

// The device the caller's buffers must be on: the CPU for a CPU backend,
// for a GPU one the device of `parameters` (the runtime placed the rank).
DLDevice device_of(meshrun::Job& job, const DLTensor& parameters) {
  const int32_t type = job.communicator("dp").comm_api().device_type;
  if (type == kDLCPU) return {kDLCPU, 0};
  return {static_cast<DLDeviceType>(type), parameters.device.device_id};
}

// With a GPU backend: the caller's streams, the comm stream set on the
// data-parallel communicators.
void use_streams(meshrun::Job& job, const meshrun_strategy_parameters& p,
                 meshrun::StrategyBuffers& buffers) {
  if (buffers.device.device_type == kDLCPU ||
      !MESHRUN_HAS_FIELD(meshrun_strategy_parameters, &p, comm_stream)) {
    return;
  }
  buffers.compute_stream = p.compute_stream;
  buffers.comm_stream = p.comm_stream;
  for (const char* axis : {"dp", "dp_shard_cp", "dp_replicate"}) {
    job.communicator(axis).set_stream(p.comm_stream);
  }
}

void create(meshrun_runtime* runtime, const meshrun_strategy_parameters& p, meshrun_strategy& s) {
  // The caller's description first, then the runtime's state: a runtime
  // that has not joined is told to join (a built mesh alone, for planning,
  // has a plan but no communicators).
  s.offsets = checked_offsets(p);
  const int64_t numel = s.offsets.back();
  // Shapes and dtypes here; the device once the runtime's backend is known.
  flat_float32(p.parameters, numel, "params->parameters", p.parameters.device);
  flat_float32(p.gradients, numel, "params->gradients", p.gradients.device);
  s.job = runtime->runtime.job();
  const meshrun::Plan& plan = runtime->runtime.plan();
  s.device = device_of(*s.job, p.parameters);
  float* values = flat_float32(p.parameters, numel, "params->parameters", s.device);
  float* gradients = flat_float32(p.gradients, numel, "params->gradients", s.device);
  meshrun::StrategyBuffers buffers{values, gradients, numel, s.offsets, {}, s.device};
  use_streams(*s.job, p, buffers);
  for (int64_t i = 0; i < p.num_parameters; ++i) buffers.parameter_names.emplace_back(p.names[i]);
  s.units.shard_group = &s.job->communicator("dp_shard_cp");
  s.units.replicate_group = &s.job->communicator("dp_replicate");
  s.units.num_units = p.num_units;
  s.units.root_unit = p.root_unit;
  s.units.parameter_units.assign(p.units, p.units + p.num_parameters);
  s.units.parameter_rows.assign(p.rows, p.rows + p.num_parameters);
  meshrun::Communicator& data_parallel = s.job->communicator("dp");
  s.strategy = std::make_unique<meshrun::Strategy>(
      plan.strategy, data_parallel, std::move(buffers),
      meshrun::strategy_options_json(runtime->runtime.config().distributed), &s.units);
  s.local =
      s.strategy->sharded()
          ? meshrun::sharded_parameters(*s.strategy, *s.units.shard_group, *s.units.replicate_group)
          : meshrun::replicated_parameters(values, gradients, s.offsets, s.job->world());
  s.layout = layout_of(p);
  s.seed = runtime->runtime.config().train.seed;
  s.unit_shapes.resize(size_t(p.num_units));
}

meshrun::Strategy& strategy_of(meshrun_strategy* strategy) {
  live(strategy, "strategy");
  return *strategy->strategy;
}

// UNIMPLEMENTED for buffers on a GPU: the calls that read host memory.
void require_host_memory(const meshrun_strategy& s) {
  if (s.device.device_type == kDLCPU) return;
  throw Error(MESHRUN_UNIMPLEMENTED,
              fmt::format("the strategy's buffers are on {}, and this call reads host memory "
                          "(not yet for GPU buffers)",
                          device_name(s.device)));
}

void set_view(DLTensor* out, const meshrun::FloatView& view, DLDevice device, int64_t& shape) {
  if (out == nullptr) return;
  shape = view.numel;
  *out = DLTensor{view.data, device, 1, meshrun::dtype_float32(), &shape, nullptr, 0};
}

// The caller's named buffers in the local shard's layout, after the
// parameters themselves.
std::vector<meshrun::FlatBuffer> checkpoint_buffers(meshrun_strategy& s, int64_t count,
                                                    const char* const* names,
                                                    const DLTensor* buffers) {
  std::vector<meshrun::FlatBuffer> all{{"params", s.local.params}};
  if (count > 0) {
    require(names, "names");
    require(buffers, "buffers");
  }
  for (int64_t k = 0; k < count; ++k) {
    require(names[k], "names[k]");
    const std::string name = names[k];
    if (name == "params" || name.empty()) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  fmt::format("checkpoint buffer {}: the name '{}' is taken or empty", k, name));
    }
    all.push_back({name, flat_float32(buffers[k], s.local.numel, "buffer '" + name + "'")});
  }
  return all;
}

}  // namespace

extern "C" {

meshrun_error* meshrun_strategy_create(meshrun_runtime* runtime,
                                       const meshrun_strategy_parameters* params,
                                       meshrun_strategy** out) {
  return guarded(__func__, [&] {
    live(runtime, "runtime");
    require(params, "params");
    require(out, "out");
    auto strategy = std::make_unique<meshrun_strategy>();
    create(runtime, *params, *strategy);
    *out = adopt(std::move(strategy));
  });
}

void meshrun_strategy_destroy(meshrun_strategy* strategy) {
  if (meshrun::host_api::forget_handle(strategy)) delete strategy;
}

meshrun_error* meshrun_strategy_sharded(const meshrun_strategy* strategy, int32_t* out) {
  return guarded(__func__, [&] {
    live(strategy, "strategy");
    require(out, "out");
    *out = strategy->strategy->sharded() ? 1 : 0;
  });
}

meshrun_error* meshrun_strategy_broadcast_parameters(meshrun_strategy* strategy) {
  return guarded(__func__, [&] { strategy_of(strategy).broadcast_parameters(); });
}

meshrun_error* meshrun_strategy_begin_micro_batch(meshrun_strategy* strategy, int32_t sync) {
  return guarded(__func__, [&] { strategy_of(strategy).begin_micro_batch(sync != 0); });
}

meshrun_error* meshrun_strategy_gradient_ready(meshrun_strategy* strategy, int64_t parameter) {
  return guarded(__func__, [&] {
    meshrun::Strategy& s = strategy_of(strategy);
    const auto& offsets = strategy->offsets;
    if (parameter < 0 || parameter + 1 >= int64_t(offsets.size())) {
      throw Error(MESHRUN_OUT_OF_RANGE,
                  fmt::format("parameter {} is outside [0, {})", parameter, offsets.size() - 1));
    }
    s.gradients_ready(offsets[size_t(parameter)], offsets[size_t(parameter) + 1]);
  });
}

meshrun_error* meshrun_strategy_finish_gradients(meshrun_strategy* strategy) {
  return guarded(__func__, [&] { strategy_of(strategy).finish_gradients(); });
}

meshrun_error* meshrun_strategy_memory_use(meshrun_strategy* strategy, int64_t* out_buffers,
                                           int64_t* out_buffers_peak,
                                           int64_t* out_buffers_reserved) {
  return guarded(__func__, [&] {
    const meshrun::StrategyMemory memory = strategy_of(strategy).memory();
    if (out_buffers != nullptr) *out_buffers = memory.buffers;
    if (out_buffers_peak != nullptr) *out_buffers_peak = memory.buffers_peak;
    if (out_buffers_reserved != nullptr) *out_buffers_reserved = memory.buffers_reserved;
  });
}

meshrun_error* meshrun_strategy_pre_forward(meshrun_strategy* strategy, int32_t unit) {
  return guarded(__func__, [&] { strategy_of(strategy).pre_forward(unit); });
}

meshrun_error* meshrun_strategy_post_forward(meshrun_strategy* strategy, int32_t unit) {
  return guarded(__func__, [&] { strategy_of(strategy).post_forward(unit); });
}

meshrun_error* meshrun_strategy_pre_backward(meshrun_strategy* strategy, int32_t unit) {
  return guarded(__func__, [&] { strategy_of(strategy).pre_backward(unit); });
}

meshrun_error* meshrun_strategy_post_backward(meshrun_strategy* strategy, int32_t unit) {
  return guarded(__func__, [&] { strategy_of(strategy).post_backward(unit); });
}

meshrun_error* meshrun_strategy_unit_views(meshrun_strategy* strategy, int32_t unit,
                                           DLTensor* parameters, DLTensor* gradients) {
  return guarded(__func__, [&] {
    const auto [values, grads] = strategy_of(strategy).unit_views(unit);
    auto& shapes = strategy->unit_shapes.at(size_t(unit));
    set_view(parameters, values, strategy->device, shapes[0]);
    set_view(gradients, grads, strategy->device, shapes[1]);
  });
}

meshrun_error* meshrun_strategy_local_shard(meshrun_strategy* strategy, DLTensor* parameters,
                                            DLTensor* gradients) {
  return guarded(__func__, [&] {
    strategy_of(strategy);
    const auto& local = strategy->local;
    set_view(parameters, {local.params, local.numel}, strategy->device, strategy->local_shape);
    set_view(gradients, {local.grads, local.numel}, strategy->device, strategy->local_shape);
  });
}

meshrun_error* meshrun_strategy_shard_segments(const meshrun_strategy* strategy,
                                               meshrun_strategy_segment* segments, int64_t capacity,
                                               int64_t* out_count) {
  return guarded(__func__, [&] {
    live(strategy, "strategy");
    require(out_count, "out_count");
    if (capacity < 0 || (segments == nullptr && capacity > 0)) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  fmt::format("capacity {} must be >= 0, and 0 when segments is NULL", capacity));
    }
    const auto& local = strategy->local;
    const auto count = int64_t(local.held.size());
    for (int64_t k = 0; k < std::min(capacity, count); ++k) {
      const auto& range = local.held[size_t(k)];
      segments[k] = {local.held_parameter[size_t(k)], range.global_begin, range.local_begin,
                     range.count};
    }
    *out_count = count;
  });
}

meshrun_error* meshrun_strategy_gradient_norm_squared(meshrun_strategy* strategy, double* out) {
  return guarded(__func__, [&] {
    strategy_of(strategy);
    require(out, "out");
    require_host_memory(*strategy);
    const auto& local = strategy->local;
    auto squared = float(meshrun::squared_norm(local.grads, local.numel));
    if (local.norm_group != nullptr) {
      meshrun::FlatTensor tensor(&squared, meshrun::dtype_float32(), 1);
      local.norm_group->all_reduce(tensor.get(), meshrun::ReduceOp::sum).wait();
    }
    *out = squared;
  });
}

meshrun_error* meshrun_strategy_gather_parameters(meshrun_strategy* strategy, DLTensor* full) {
  return guarded(__func__, [&] {
    meshrun::Strategy& s = strategy_of(strategy);
    require(full, "full");
    const int64_t numel = strategy->offsets.back();
    float* data = flat_float32(*full, numel, "full", strategy->device);
    if (!s.sharded()) require_host_memory(*strategy);
    if (s.sharded()) {
      s.gather_parameters(data, numel);
    } else {
      std::copy_n(strategy->local.params, numel, data);
    }
  });
}

meshrun_error* meshrun_strategy_save_checkpoint(meshrun_strategy* strategy, const char* dir,
                                                int64_t step, int64_t num_buffers,
                                                const char* const* names, const DLTensor* buffers) {
  return guarded(__func__, [&] {
    strategy_of(strategy);
    require(dir, "dir");
    require_host_memory(*strategy);
    meshrun::save_sharded(dir, strategy->layout, strategy->seed, step, strategy->local.saved,
                          checkpoint_buffers(*strategy, num_buffers, names, buffers),
                          strategy->job->host_world());
  });
}

meshrun_error* meshrun_strategy_load_checkpoint(meshrun_strategy* strategy, const char* dir,
                                                int64_t num_buffers, const char* const* names,
                                                DLTensor* buffers, int64_t* out_step) {
  return guarded(__func__, [&] {
    strategy_of(strategy);
    require(dir, "dir");
    require_host_memory(*strategy);
    const auto index = meshrun::read_index(dir, strategy->layout);
    const auto wanted = checkpoint_buffers(*strategy, num_buffers, names, buffers);
    for (const auto& buffer : wanted) {
      if (std::find(index.buffers.begin(), index.buffers.end(), buffer.name) ==
          index.buffers.end()) {
        throw Error(MESHRUN_INVALID_ARGUMENT,
                    fmt::format("checkpoint '{}' holds no buffer '{}'", dir, buffer.name));
      }
    }
    meshrun::load_sharded(index, strategy->local.held, wanted);
    if (out_step != nullptr) *out_step = index.step;
  });
}

}  // extern "C"
