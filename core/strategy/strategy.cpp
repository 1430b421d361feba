#include "strategy/strategy.hpp"

#include <fmt/format.h>

#include <utility>

#include "errors.hpp"

namespace meshrun {

namespace {

// `library`, once it is known to be a strategy whose table has the training
// entry points of ABI 1.2: fsdp2 and megatron_fsdp still ship 1.0-sized
// tables (mesh rules only), and the message says so rather than failing later.
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

DLTensor flat_float32(float* data, int64_t& numel) {
  return DLTensor{data, {kDLCPU, 0}, 1, dtype_float32(), &numel, nullptr, 0};
}

}  // namespace

bool strategy_can_train(const PluginLibrary& library) {
  const meshrun_strategy_api* s = library.api().strategy;
  return s != nullptr && s->struct_size >= MESHRUN_STRATEGY_API_SIZE_1_2 && s->setup != nullptr &&
         s->broadcast_parameters != nullptr && s->begin_micro_batch != nullptr &&
         s->gradients_ready != nullptr && s->finish_gradients != nullptr && s->memory != nullptr;
}

Strategy::Strategy(std::shared_ptr<PluginLibrary> library, Communicator& data_parallel,
                   StrategyBuffers buffers, const std::string& options_json)
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
  setup.parameters = flat_float32(buffers_.parameters, buffers_.numel);
  setup.gradients = flat_float32(buffers_.gradients, buffers_.numel);
  setup.num_parameters = num_parameters;
  setup.parameter_offsets = buffers_.parameter_offsets.data();
  setup.parameter_names = name_pointers_.data();
  setup.options_json = options_json_.c_str();
  call(api().setup(instance_.handle(), &setup), "setup");
}

void Strategy::broadcast_parameters() {
  call(api().broadcast_parameters(instance_.handle()), "broadcast_parameters");
}

void Strategy::begin_micro_batch(bool sync) {
  call(api().begin_micro_batch(instance_.handle(), sync ? 1 : 0), "begin_micro_batch");
}

void Strategy::gradients_ready(int64_t begin, int64_t end) {
  call(api().gradients_ready(instance_.handle(), begin, end), "gradients_ready");
}

void Strategy::finish_gradients() {
  call(api().finish_gradients(instance_.handle()), "finish_gradients");
}

int64_t Strategy::buffer_bytes() {
  meshrun_strategy_memory memory{};
  memory.struct_size = sizeof(meshrun_strategy_memory);
  call(api().memory(instance_.handle(), &memory), "memory");
  return memory.buffers;
}

void Strategy::call(meshrun_error* error, const char* entry_point) const {
  throw_if_error(error, fmt::format("strategy {} {}", library().name(), entry_point));
}

}  // namespace meshrun
