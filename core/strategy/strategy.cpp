#include "strategy/strategy.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "errors.hpp"
#include "plugin/call_scope.hpp"

namespace meshrun {

namespace {

// `library`, once it is known to be a strategy whose table has its training
// entry points: megatron_fsdp still ships a 1.0-sized table (mesh rules
// only), and the message says so rather than failing later.
std::shared_ptr<PluginLibrary> require_training_entry_points(
    std::shared_ptr<PluginLibrary> library) {
  const meshrun_plugin_api& api = library->api();
  if (library->kind() != PluginKind::strategy || api.strategy == nullptr) {
    throw invalid_argument(fmt::format("plugin {} is a {} plugin, not a strategy", library->path(),
                                       plugin_kind_name(library->kind())));
  }
  if (!strategy_can_train(*library)) {
    throw Error(MESHRUN_UNIMPLEMENTED,
                fmt::format("strategy plugin {} (ABI {}.{}) has no training entry points: "
                            "training with strategy {} is not implemented yet",
                            library->path(), api.abi_major, api.abi_minor, library->name()));
  }
  return library;
}

DLTensor flat_float32(float* data, DLDevice device, int64_t& numel) {
  return DLTensor{data, device, 1, dtype_float32(), &numel, nullptr, 0};
}

// A table is sharded when it reaches gather_parameters and sets local_shard
// (meshrun/strategy.h).
bool table_is_sharded(const meshrun_strategy_api& s) {
  return s.struct_size >= MESHRUN_STRATEGY_API_SIZE_1_3 && s.gather_parameters != nullptr &&
         s.local_shard != nullptr;
}

bool has_sharded_entry_points(const meshrun_strategy_api& s) {
  return s.pre_forward != nullptr && s.post_forward != nullptr && s.pre_backward != nullptr &&
         s.post_backward != nullptr && s.unit_views != nullptr && s.shard_segments != nullptr;
}

}  // namespace

template <class Call>
void Strategy::call(const char* entry_point, Call&& body) const {
  throw_if_error(call_plugin(library(), entry_point, std::forward<Call>(body)),
                 fmt::format("strategy {} {}", library().name(), entry_point));
}

bool strategy_can_train(const PluginLibrary& library) {
  const meshrun_strategy_api* s = library.api().strategy;
  return s != nullptr && s->struct_size >= MESHRUN_STRATEGY_API_SIZE_1_2 && s->setup != nullptr &&
         s->broadcast_parameters != nullptr && s->begin_micro_batch != nullptr &&
         s->gradients_ready != nullptr && s->finish_gradients != nullptr && s->memory != nullptr &&
         (!table_is_sharded(*s) || has_sharded_entry_points(*s));
}

bool strategy_shards(const PluginLibrary& library) {
  const meshrun_strategy_api* s = library.api().strategy;
  return s != nullptr && table_is_sharded(*s);
}

bool strategy_takes_weights_by_shard(const PluginLibrary& library) {
  const meshrun_strategy_api* s = library.api().strategy;
  return strategy_shards(library) && s->struct_size >= MESHRUN_STRATEGY_API_SIZE_1_6 &&
         s->weights_by_shard != 0;
}

std::optional<StrategyMemoryPlan> plan_strategy_memory(std::shared_ptr<PluginLibrary> library,
                                                       const StrategyBuffers& layout,
                                                       const StrategyUnits& units,
                                                       int64_t shard_ranks, int64_t replicate_ranks,
                                                       const std::string& options_json) {
  const meshrun_strategy_api* s = library->api().strategy;
  if (s == nullptr || s->struct_size < MESHRUN_STRATEGY_API_SIZE_1_6 || s->plan_memory == nullptr) {
    if (s != nullptr && table_is_sharded(*s)) return std::nullopt;
    return StrategyMemoryPlan{layout.numel, 0};
  }
  std::vector<const char*> names;
  for (const auto& name : layout.parameter_names) names.push_back(name.c_str());
  meshrun_strategy_plan_input input{};
  input.struct_size = sizeof(input);
  input.options_json = options_json.c_str();
  input.num_parameters = static_cast<int64_t>(names.size());
  input.parameter_offsets = layout.parameter_offsets.data();
  input.parameter_names = names.data();
  input.num_units = units.num_units;
  input.root_unit = units.root_unit;
  input.parameter_units = units.parameter_units.data();
  input.parameter_rows = units.parameter_rows.data();
  input.shard_ranks = shard_ranks;
  input.replicate_ranks = replicate_ranks;
  meshrun_strategy_memory_plan out{};
  out.struct_size = sizeof(out);
  const PluginInstance instance(library);
  throw_if_error(call_plugin(instance.library(), "plan_memory",
                             [&] { return s->plan_memory(instance.handle(), &input, &out); }),
                 fmt::format("strategy {} plan_memory", library->name()));
  return StrategyMemoryPlan{out.local_numel, out.buffers_held};
}

Strategy::Strategy(std::shared_ptr<PluginLibrary> library, Communicator& data_parallel,
                   StrategyBuffers buffers, const std::string& options_json,
                   const StrategyUnits* units)
    : buffers_(std::move(buffers)),
      options_json_(options_json),
      instance_(require_training_entry_points(std::move(library))) {
  const auto num_parameters = static_cast<int64_t>(buffers_.parameter_names.size());
  if (static_cast<int64_t>(buffers_.parameter_offsets.size()) != num_parameters + 1) {
    throw invalid_argument(fmt::format(
        "strategy buffers: {} parameter offsets for {} parameters (need one more than names)",
        buffers_.parameter_offsets.size(), num_parameters));
  }
  if (buffers_.parameter_offsets.back() != buffers_.numel) {
    throw invalid_argument(fmt::format("strategy buffers: parameter offsets end at {}, not at {}",
                                       buffers_.parameter_offsets.back(), buffers_.numel));
  }
  for (const auto& name : buffers_.parameter_names) name_pointers_.push_back(name.c_str());

  meshrun_strategy_setup setup{};
  setup.struct_size = sizeof(meshrun_strategy_setup);
  setup.comm = &data_parallel.comm_api();
  setup.data_parallel = data_parallel.handle();
  setup.parameters = flat_float32(buffers_.parameters, buffers_.device, buffers_.numel);
  setup.gradients = flat_float32(buffers_.gradients, buffers_.device, buffers_.numel);
  setup.compute_stream = buffers_.compute_stream;
  setup.comm_stream = buffers_.comm_stream;
  setup.num_parameters = num_parameters;
  setup.parameter_offsets = buffers_.parameter_offsets.data();
  setup.parameter_names = name_pointers_.data();
  setup.options_json = options_json_.c_str();
  if (sharded()) fill_units(setup, units);
  if (buffers_.parameters == nullptr && buffers_.numel > 0) {
    setup.initial_weights = by_shard_weights();
  }
  call("setup", [&] { return api().setup(instance_.handle(), &setup); });
}

int32_t Strategy::by_shard_weights() const {
  if (!strategy_takes_weights_by_shard(library())) {
    throw invalid_argument(fmt::format(
        "strategy plugin {} does not take weights by shard (ABI 1.6 weights_by_shard): the host "
        "must hand it the whole model at setup",
        library().path()));
  }
  return MESHRUN_INITIAL_WEIGHTS_BY_SHARD;
}

void Strategy::fill_units(meshrun_strategy_setup& setup, const StrategyUnits* units) {
  if (units == nullptr) {
    throw invalid_argument(fmt::format(
        "strategy {} shards the parameters: it needs the units and the shard and replicate "
        "groups (StrategyUnits)",
        library().name()));
  }
  const auto num_parameters = buffers_.parameter_names.size();
  if (units->parameter_units.size() != num_parameters ||
      units->parameter_rows.size() != num_parameters) {
    throw invalid_argument(
        fmt::format("strategy units: {} parameter units and {} parameter rows for {} parameters",
                    units->parameter_units.size(), units->parameter_rows.size(), num_parameters));
  }
  units_ = *units;
  setup.shard_group = units_.shard_group != nullptr ? units_.shard_group->handle() : nullptr;
  setup.replicate_group =
      units_.replicate_group != nullptr ? units_.replicate_group->handle() : nullptr;
  setup.num_units = units_.num_units;
  setup.root_unit = units_.root_unit;
  setup.parameter_units = units_.parameter_units.data();
  setup.parameter_rows = units_.parameter_rows.data();
  // What the unit views must hold. Units out of range are the strategy's
  // to refuse in setup.
  const auto num_units = static_cast<size_t>(std::max(units_.num_units, 0));
  unit_numel_.assign(num_units, 0);
  in_backward_.assign(num_units, false);
  for (size_t p = 0; p < num_parameters; ++p) {
    const auto unit = static_cast<size_t>(units_.parameter_units[p]);
    if (unit < num_units) {
      unit_numel_[unit] += buffers_.parameter_offsets[p + 1] - buffers_.parameter_offsets[p];
    }
  }
}

bool Strategy::sharded() const { return table_is_sharded(api()); }

void Strategy::broadcast_parameters() {
  call("broadcast_parameters", [&] { return api().broadcast_parameters(instance_.handle()); });
}

void Strategy::begin_micro_batch(bool sync) {
  call("begin_micro_batch",
       [&] { return api().begin_micro_batch(instance_.handle(), sync ? 1 : 0); });
}

void Strategy::gradients_ready(int64_t begin, int64_t end) {
  call("gradients_ready", [&] { return api().gradients_ready(instance_.handle(), begin, end); });
}

void Strategy::finish_gradients() {
  call("finish_gradients", [&] { return api().finish_gradients(instance_.handle()); });
}

StrategyMemory Strategy::memory() {
  meshrun_strategy_memory memory{};
  memory.struct_size = sizeof(meshrun_strategy_memory);
  call("memory", [&] { return api().memory(instance_.handle(), &memory); });
  // A strategy of ABI 1.2 leaves the peak unwritten (zero).
  return {memory.buffers, std::max(memory.buffers, memory.buffers_peak),
          std::max(memory.buffers, memory.buffers_reserved)};
}

void Strategy::pre_forward(int32_t unit) {
  require_sharded("pre_forward");
  call("pre_forward", [&] { return api().pre_forward(instance_.handle(), unit); });
}

void Strategy::post_forward(int32_t unit) {
  require_sharded("post_forward");
  call("post_forward", [&] { return api().post_forward(instance_.handle(), unit); });
}

void Strategy::pre_backward(int32_t unit) {
  require_sharded("pre_backward");
  call("pre_backward", [&] { return api().pre_backward(instance_.handle(), unit); });
  if (unit >= 0 && static_cast<size_t>(unit) < in_backward_.size()) {
    in_backward_[static_cast<size_t>(unit)] = true;
  }
}

void Strategy::post_backward(int32_t unit) {
  require_sharded("post_backward");
  if (unit >= 0 && static_cast<size_t>(unit) < in_backward_.size()) {
    in_backward_[static_cast<size_t>(unit)] = false;
  }
  call("post_backward", [&] { return api().post_backward(instance_.handle(), unit); });
}

std::pair<FloatView, FloatView> Strategy::unit_views(int32_t unit) {
  require_sharded("unit_views");
  DLTensor parameters{};
  DLTensor gradients{};
  call("unit_views",
       [&] { return api().unit_views(instance_.handle(), unit, &parameters, &gradients); });
  const std::string where = fmt::format("unit_views(unit {})", unit);
  const int64_t numel = unit_numel(unit, where);
  const char* expected = "the unit's parameter elements";
  const FloatView parameter_view = float_view(parameters, where, "parameters", false);
  check_length(parameter_view.numel, numel, where, "parameters", expected);
  // Gradient views exist in the unit's backward only.
  const bool in_backward = in_backward_[static_cast<size_t>(unit)];
  const std::string gradients_where = in_backward ? where + " in the unit's backward" : where;
  const FloatView gradient_view = float_view(gradients, gradients_where, "gradients", !in_backward);
  if (gradient_view.data != nullptr) {
    check_length(gradient_view.numel, numel, gradients_where, "gradients", expected);
  }
  return {parameter_view, gradient_view};
}

Bfloat16View Strategy::unit_views_bfloat16(int32_t unit) {
  require_sharded("unit_views_bfloat16");
  if (api().struct_size < MESHRUN_STRATEGY_API_SIZE_1_12 || api().unit_views_bfloat16 == nullptr) {
    return {};
  }
  DLTensor parameters{};
  call("unit_views_bfloat16",
       [&] { return api().unit_views_bfloat16(instance_.handle(), unit, &parameters); });
  const std::string where = fmt::format("unit_views_bfloat16(unit {})", unit);
  const int64_t numel = unit_numel(unit, where);
  const auto [data, view_numel] =
      flat_view(parameters, where, "parameters", true, dtype_bfloat16(), "bfloat16");
  if (data == nullptr) return {};
  check_length(view_numel, numel, where, "parameters", "the unit's parameter elements");
  return {static_cast<const uint16_t*>(data), view_numel};
}

int64_t Strategy::unit_numel(int32_t unit, const std::string& where) const {
  if (unit < 0 || static_cast<size_t>(unit) >= unit_numel_.size()) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("strategy {} {}: views handed back for a unit not in [0, {})",
                            library().name(), where, unit_numel_.size()));
  }
  return unit_numel_[static_cast<size_t>(unit)];
}

std::pair<FloatView, FloatView> Strategy::local_shard() {
  require_sharded("local_shard");
  DLTensor parameters{};
  DLTensor gradients{};
  call("local_shard",
       [&] { return api().local_shard(instance_.handle(), &parameters, &gradients); });
  const FloatView parameter_view = float_view(parameters, "local_shard", "parameters", false);
  const FloatView gradient_view = float_view(gradients, "local_shard", "gradients", false);
  check_length(gradient_view.numel, parameter_view.numel, "local_shard", "gradients",
               "as many as the parameters view");
  return {parameter_view, gradient_view};
}

std::vector<meshrun_shard_segment> Strategy::shard_segments() {
  require_sharded("shard_segments");
  int64_t count = 0;
  call("shard_segments",
       [&] { return api().shard_segments(instance_.handle(), nullptr, 0, &count); });
  std::vector<meshrun_shard_segment> segments(static_cast<size_t>(count));
  call("shard_segments",
       [&] { return api().shard_segments(instance_.handle(), segments.data(), count, &count); });
  segments.resize(std::min(segments.size(), static_cast<size_t>(count)));
  return segments;
}

void Strategy::gather_parameters(float* full, int64_t numel) {
  require_sharded("gather_parameters");
  DLTensor tensor = flat_float32(full, buffers_.device, numel);
  call("gather_parameters", [&] { return api().gather_parameters(instance_.handle(), &tensor); });
}

FloatView Strategy::float_view(const DLTensor& tensor, const std::string& where, const char* what,
                               bool may_be_null) const {
  const auto [data, numel] =
      flat_view(tensor, where, what, may_be_null, dtype_float32(), "float32");
  return {static_cast<float*>(data), numel};
}

std::pair<void*, int64_t> Strategy::flat_view(const DLTensor& tensor, const std::string& where,
                                              const char* what, bool may_be_null,
                                              DLDataType expected, const char* dtype_name) const {
  if (tensor.data == nullptr && may_be_null) return {};
  const auto fail = [&](const std::string& problem) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("strategy {} {}: {} view {}", library().name(), where, what, problem));
  };
  const DLDevice device = buffers_.device;
  if (tensor.device.device_type != device.device_type ||
      tensor.device.device_id != device.device_id) {
    fail(fmt::format("is on device type {} id {}, expected the buffers' device type {} id {}",
                     static_cast<int>(tensor.device.device_type), tensor.device.device_id,
                     static_cast<int>(device.device_type), device.device_id));
  }
  const DLDataType dtype = tensor.dtype;
  if (dtype.code != expected.code || dtype.bits != expected.bits || dtype.lanes != 1) {
    fail(fmt::format("has dtype code {} bits {}{}, expected {}", dtype.code, dtype.bits,
                     dtype.lanes != 1 ? fmt::format(" lanes {}", dtype.lanes) : "", dtype_name));
  }
  if (tensor.ndim != 1) fail(fmt::format("has {} dimensions, expected 1", tensor.ndim));
  if (tensor.shape == nullptr) fail("has no shape (shape is NULL)");
  if (tensor.shape[0] < 0) fail(fmt::format("has {} elements", tensor.shape[0]));
  if (tensor.strides != nullptr && tensor.strides[0] != 1) {
    fail(fmt::format("has stride {}, expected 1", tensor.strides[0]));
  }
  // A view of no elements needs no memory.
  if (tensor.data == nullptr && tensor.shape[0] > 0) fail("has data NULL");
  return {static_cast<std::byte*>(tensor.data) + tensor.byte_offset, tensor.shape[0]};
}

void Strategy::check_length(int64_t view_numel, int64_t numel, const std::string& where,
                            const char* what, const char* expected) const {
  if (view_numel == numel) return;
  throw Error(MESHRUN_INTERNAL,
              fmt::format("strategy {} {}: {} view has {} elements, expected {} ({})",
                          library().name(), where, what, view_numel, numel, expected));
}

void Strategy::require_sharded(const char* entry_point) const {
  if (!sharded()) {
    throw Error(MESHRUN_UNIMPLEMENTED,
                fmt::format("strategy {} does not shard parameters: it has no {} (ABI 1.3)",
                            library().name(), entry_point));
  }
}

std::string strategy_options_json(const DistributedConfig& d) {
  if (d.strategy == "megatron_fsdp") {
    return nlohmann::json{{"zero_dp_strategy", d.zero_dp_strategy},
                          {"overlap_grad_reduce", d.overlap_grad_reduce},
                          {"overlap_param_gather", d.overlap_param_gather},
                          {"fsdp_double_buffer", d.fsdp_double_buffer},
                          {"disable_bucketing", d.disable_bucketing},
                          {"average_in_collective", d.average_in_collective},
                          {"report_nan_in_param_grad", d.report_nan_in_param_grad},
                          {"check_for_nan_in_grad", d.check_for_nan_in_grad}}
        .dump();
  }
  if (d.strategy != "fsdp2") {
    return nlohmann::json{{"bucket_cap_mb", d.bucket_cap_mb},
                          {"broadcast_buffers", d.broadcast_buffers},
                          {"find_unused_parameters", d.find_unused_parameters},
                          {"gradient_as_bucket_view", d.gradient_as_bucket_view},
                          {"static_graph", d.static_graph}}
        .dump();
  }
  const MixedPrecisionConfig& mp = d.mp_policy;
  nlohmann::json options{{"pp_size", d.pp_size},
                         {"dp_replicate_size", d.dp_replicate_size},
                         {"reshard_after_forward", nullptr},
                         {"defer_fsdp_grad_sync", d.defer_fsdp_grad_sync},
                         {"enable_fsdp2_prefetch", d.enable_fsdp2_prefetch},
                         {"fsdp2_forward_prefetch_depth", d.fsdp2_forward_prefetch_depth},
                         {"fsdp2_backward_prefetch_depth", d.fsdp2_backward_prefetch_depth},
                         {"mp_policy",
                          {{"param_dtype", mp.param_dtype},
                           {"reduce_dtype", mp.reduce_dtype},
                           {"output_dtype", mp.output_dtype},
                           {"cast_forward_inputs", mp.cast_forward_inputs}}}};
  if (d.reshard_after_forward) options["reshard_after_forward"] = *d.reshard_after_forward;
  return options.dump();
}

}  // namespace meshrun
