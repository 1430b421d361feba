#include "model/model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "config/config.hpp"
#include "errors.hpp"
#include "plugin/call_scope.hpp"
#include "support/suggest.hpp"
#include "trace/trace.hpp"

namespace meshrun {
namespace {

using nlohmann::ordered_json;

// Holds a string the plugin allocated with the host services; frees it.
class PluginString {
 public:
  PluginString() = default;
  ~PluginString() { host_services().deallocate(host_services().context, text_); }
  PluginString(const PluginString&) = delete;
  PluginString& operator=(const PluginString&) = delete;
  char** out() { return &text_; }
  std::string str() const { return text_ != nullptr ? text_ : ""; }

 private:
  char* text_ = nullptr;
};

// "model.<key>: reason" from a plugin: the key, so the host can point at it.
std::string key_of(const std::string& message) {
  const auto colon = message.find(": ");
  if (colon == std::string::npos || message.rfind("model.", 0) != 0) return "model";
  return message.substr(0, colon);
}

void refuse_unknown_keys(const PluginLibrary& library, const ordered_json& config) {
  const std::vector<std::string> known = model_config_keys(library);
  for (const auto& [name, value] : config.items()) {
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    const std::string key = "model." + name;
    throw Error(MESHRUN_INVALID_ARGUMENT,
                fmt::format("{}: unknown key for model_type '{}'{}; valid keys in [model]: "
                            "model_type, torch_dtype, checkpoint, {}",
                            key, library.name(),
                            did_you_mean(name, known) + misplaced_key_hint(name, "model"),
                            join_names(known)),
                key);
  }
}

meshrun_model* create_model(const PluginInstance& instance, const ordered_json& config) {
  const meshrun_model_api& api = *instance.library().api().model;
  refuse_unknown_keys(instance.library(), config);
  meshrun_model* model = nullptr;
  const std::string text = config.dump();
  meshrun_error* error = call_plugin(instance.library(), "model_create", [&] {
    return api.model_create(instance.handle(), text.c_str(), &model);
  });
  if (error != nullptr) {
    const int32_t code = error->code;
    const std::string message = error->message != nullptr ? error->message : "";
    meshrun_error_release(error);
    throw Error(code, message, key_of(message));
  }
  if (model == nullptr) {
    throw Error(MESHRUN_INTERNAL, fmt::format("model plugin {}: model_create succeeded but "
                                              "returned no model",
                                              instance.library().path()));
  }
  return model;
}

// A flat float32 argument of `numel` elements on `device`, or none (NULL)
// without data.
class FloatArgument {
 public:
  FloatArgument(const float* data, int64_t numel, DLDevice device)
      : numel_(numel),
        tensor_{const_cast<float*>(data), device, 1, dtype_float32(), &numel_, nullptr, 0} {}
  FloatArgument(const FloatArgument&) = delete;
  FloatArgument& operator=(const FloatArgument&) = delete;
  DLTensor* get() { return tensor_.data != nullptr ? &tensor_ : nullptr; }

 private:
  int64_t numel_;
  DLTensor tensor_;
};

}  // namespace

std::vector<std::string> model_config_keys(const PluginLibrary& library) {
  std::vector<std::string> keys;
  const char* const* list = library.api().model->config_keys;
  for (; list != nullptr && *list != nullptr; ++list) keys.emplace_back(*list);
  return keys;
}

Model::Model(std::shared_ptr<PluginLibrary> library, const ordered_json& config)
    : instance_(std::move(library)), model_(create_model(instance_, config)) {
  try {
    PluginString text;
    throw_if_error(call_plugin(this->library(), "describe",
                               [&] { return api().describe(model_, text.out()); }),
                   fmt::format("model plugin {}: describe", this->library().path()));
    description_ = parse_description(text.str(), this->library().path());
  } catch (...) {
    destroy();
    throw;
  }
}

Model::~Model() { destroy(); }

void Model::destroy() {
  call_plugin(library(), "model_destroy", [&] { api().model_destroy(model_); });
}

bool Model::splits_backward() const {
  return api().backward_input != nullptr && api().backward_weight != nullptr;
}

void Model::init_parameter(uint64_t seed, int64_t parameter, float* values) const {
  const ModelParameter& p = description_.parameters.at(size_t(parameter));
  DLTensor tensor{values,
                  {kDLCPU, 0},
                  int32_t(p.shape.size()),
                  dtype_float32(),
                  const_cast<int64_t*>(p.shape.data()),
                  nullptr,
                  0};
  throw_if_error(
      call_plugin(library(), "init_parameter",
                  [&] { return api().init_parameter(model_, seed, parameter, &tensor); }),
      fmt::format("model plugin {}: init_parameter '{}'", library().path(), p.name));
}

void Model::init_parameters(uint64_t seed, float* values) const {
  for (size_t p = 0; p < description_.parameters.size(); ++p) {
    init_parameter(seed, int64_t(p), values + description_.parameters[p].offset);
  }
}

// The C hook table over StageHooks: turns exceptions into error objects
// and checks that the model asks only for parameters of the units it is in.
struct ModelStage::Bridge {
  Bridge(StageHooks& hooks, const ModelDescription& description, std::vector<bool> held,
         DLDevice device)
      : hooks(hooks), description(description), held(std::move(held)), device(device) {
    table.struct_size = sizeof(table);
    table.context = this;
    table.pre_forward = &pre_forward;
    table.post_forward = &post_forward;
    table.pre_backward = &pre_backward;
    table.post_backward = &post_backward;
    table.gradient_ready = &gradient_ready;
    table.parameter = &parameter;
    table.parameter_bfloat16 = &parameter_bfloat16;
  }

  template <class Body>
  static meshrun_error* guarded(void* context, Body&& body) noexcept {
    try {
      body(*static_cast<Bridge*>(context));
      return nullptr;
    } catch (const Error& error) {
      return host_services().make_error(host_services().context, error.code(), error.what());
    } catch (const std::exception& error) {
      return host_services().make_error(host_services().context, MESHRUN_INTERNAL, error.what());
    } catch (...) {
      return host_services().make_error(host_services().context, MESHRUN_INTERNAL,
                                        "unknown C++ exception in a stage hook");
    }
  }

  void check_unit(int32_t unit, const char* hook) const {
    if (unit < 0 || size_t(unit) >= description.units.size()) {
      throw Error(MESHRUN_OUT_OF_RANGE, fmt::format("{}: unit {} is outside [0, {})", hook, unit,
                                                    description.units.size()));
    }
  }
  void enter(int32_t unit, bool in_backward, const char* hook) {
    check_unit(unit, hook);
    entered[unit] = in_backward;
  }
  void leave(int32_t unit, const char* hook) {
    check_unit(unit, hook);
    if (entered.erase(unit) == 0) {
      throw Error(MESHRUN_FAILED_PRECONDITION, fmt::format("{}({}) without its pre_ hook", hook,
                                                           description.units[size_t(unit)]));
    }
  }
  // The unit's compute in the trace: from the end of its pre_ hook to the
  // start of its post_ hook (the strategy's work in the hooks is traced
  // apart).
  void computing(int32_t unit) {
    if (trace::Trace::process().on()) computing_since[unit] = trace::Trace::Clock::now();
  }
  void computed(int32_t unit, const char* pass) {
    trace::Trace& trace = trace::Trace::process();
    const auto since = computing_since.find(unit);
    if (!trace.on() || since == computing_since.end()) return;
    trace.span(fmt::format("{} {}", pass, description.units[size_t(unit)]), trace::kComputeSpan,
               since->second, trace::Trace::Clock::now());
  }
  float* hidden(DLTensor* tensor, int64_t& numel) const {
    if (tensor == nullptr || tensor->data == nullptr) return numel = 0, nullptr;
    if (tensor->dtype.code != kDLFloat || tensor->dtype.bits != 32) {
      throw Error(MESHRUN_INVALID_ARGUMENT, "hidden states at a unit boundary must be float32");
    }
    numel = 1;
    for (int32_t d = 0; d < tensor->ndim; ++d) numel *= tensor->shape[d];
    return reinterpret_cast<float*>(static_cast<char*>(tensor->data) + tensor->byte_offset);
  }

  static meshrun_error* pre_forward(void* context, int32_t unit, DLTensor* input) {
    return guarded(context, [&](Bridge& b) {
      b.enter(unit, false, "pre_forward");
      int64_t numel = 0;
      float* data = b.hidden(input, numel);
      b.hooks.pre_forward(unit, data, numel);
      b.computing(unit);
    });
  }
  static meshrun_error* post_forward(void* context, int32_t unit, DLTensor* output) {
    return guarded(context, [&](Bridge& b) {
      b.computed(unit, "forward");
      int64_t numel = 0;
      float* data = b.hidden(output, numel);
      b.hooks.post_forward(unit, data, numel);
      b.leave(unit, "post_forward");
    });
  }
  static meshrun_error* pre_backward(void* context, int32_t unit) {
    return guarded(context, [&](Bridge& b) {
      b.enter(unit, true, "pre_backward");
      b.hooks.pre_backward(unit);
      b.computing(unit);
    });
  }
  static meshrun_error* post_backward(void* context, int32_t unit) {
    return guarded(context, [&](Bridge& b) {
      b.computed(unit, "backward");
      b.hooks.post_backward(unit);
      b.leave(unit, "post_backward");
    });
  }
  static meshrun_error* gradient_ready(void* context, int64_t parameter) {
    return guarded(context, [&](Bridge& b) {
      b.check_held(parameter, "gradient_ready");
      b.hooks.gradient_ready(parameter);
    });
  }
  void check_held(int64_t parameter, const char* hook) const {
    if (parameter < 0 || size_t(parameter) >= held.size() || !held[size_t(parameter)]) {
      throw Error(MESHRUN_OUT_OF_RANGE,
                  fmt::format("{}: parameter {} is not one of the stage's", hook, parameter));
    }
  }
  // Parameter `index`'s storage, which the model may ask for between its
  // unit's pre_ and post_ hooks only; `hook` names the hook in errors.
  ParameterStorage storage(int64_t index, const char* hook) {
    check_held(index, hook);
    const ModelParameter& p = description.parameters[size_t(index)];
    const auto unit = entered.find(p.unit);
    if (unit == entered.end()) {
      throw Error(MESHRUN_FAILED_PRECONDITION,
                  fmt::format("{}: parameter '{}' asked for outside the pre_/post_ hooks of its "
                              "unit '{}'",
                              hook, p.name, description.units[size_t(p.unit)]));
    }
    return hooks.parameter(index, unit->second);
  }
  DLTensor view(int64_t index, const void* data, DLDataType dtype) const {
    const ModelParameter& p = description.parameters[size_t(index)];
    return DLTensor{const_cast<void*>(data),
                    device,
                    int32_t(p.shape.size()),
                    dtype,
                    const_cast<int64_t*>(p.shape.data()),
                    nullptr,
                    0};
  }
  static meshrun_error* parameter(void* context, int64_t index, DLTensor* value,
                                  DLTensor* gradient) {
    return guarded(context, [&](Bridge& b) {
      const ParameterStorage storage = b.storage(index, "parameter");
      if (value != nullptr) *value = b.view(index, storage.value, dtype_float32());
      if (gradient != nullptr) *gradient = b.view(index, storage.gradient, dtype_float32());
    });
  }
  static meshrun_error* parameter_bfloat16(void* context, int64_t index, DLTensor* value) {
    return guarded(context, [&](Bridge& b) {
      if (value == nullptr) {
        throw Error(MESHRUN_INVALID_ARGUMENT, "parameter_bfloat16: value is NULL");
      }
      *value = b.view(index, b.storage(index, "parameter_bfloat16").bfloat16, dtype_bfloat16());
    });
  }

  StageHooks& hooks;
  const ModelDescription& description;
  std::vector<bool> held;
  DLDevice device;                  // where the parameter storages the hooks return are
  std::map<int32_t, bool> entered;  // unit -> in a backward
  std::map<int32_t, trace::Trace::Clock::time_point> computing_since;
  meshrun_model_hooks table{};
};

StageContents stage_contents(const Model& model, const std::vector<std::string>& modules) {
  return stage_contents(model, modules, ExpertPlacement{});
}

StageContents stage_contents(const Model& model, const std::vector<std::string>& modules,
                             const ExpertPlacement& experts) {
  const ModelDescription& d = model.description();
  std::vector<bool> held(d.parameters.size(), false);
  for (const std::string& name : modules) {
    const int64_t index = d.module_index(name);
    if (index < 0) {
      throw invalid_argument(
          fmt::format("model plugin {}: a stage names module '{}', which the "
                      "description does not have",
                      model.library().path(), name));
    }
    for (const int64_t p : d.modules[size_t(index)].parameters) held[size_t(p)] = true;
  }
  StageContents contents;
  std::set<int32_t> units;
  for (size_t p = 0; p < held.size(); ++p) {
    if (!held[p] || !experts.holds(d, d.parameters[p])) continue;
    contents.parameters.push_back(int64_t(p));
    units.insert(d.parameters[p].unit);
  }
  contents.units.assign(units.begin(), units.end());
  return contents;
}

StrategyUnitNumbers strategy_unit_numbers(const ModelDescription& d,
                                          const std::vector<int32_t>& held_units) {
  StrategyUnitNumbers numbers;
  numbers.of_model_unit.assign(d.units.size(), -1);
  const auto held = [&](int32_t u) {
    return std::find(held_units.begin(), held_units.end(), u) != held_units.end();
  };
  bool enclosed = held(d.root_unit());
  for (const int32_t u : d.forward_units()) {
    if (!held(u)) continue;
    numbers.of_model_unit[size_t(u)] = numbers.num_units++;
    enclosed = enclosed || !d.is_layer_unit(u);
  }
  if (enclosed) {
    numbers.root_unit = numbers.num_units++;
    numbers.of_model_unit[size_t(d.root_unit())] = numbers.root_unit;
  }
  return numbers;
}

ModelStage::ModelStage(const Model& model, const std::vector<std::string>& modules,
                       StageHooks& hooks, const StageCommunicators& comms,
                       const std::string& plan_json, const std::string& options_json,
                       const ModelDescription* local, const StageDevice& device)
    : model_(model),
      device_(device),
      contents_(stage_contents(model, modules,
                               comms.ep != nullptr
                                   ? ExpertPlacement{comms.ep->rank(), comms.ep->size()}
                                   : ExpertPlacement{})) {
  std::vector<bool> held(model.description().parameters.size(), false);
  for (const int64_t p : contents_.parameters) held[size_t(p)] = true;
  bridge_ = std::make_unique<Bridge>(hooks, local != nullptr ? *local : model.description(),
                                     std::move(held), device.device);
  std::vector<const char*> names;
  for (const std::string& name : modules) names.push_back(name.c_str());

  meshrun_model_stage_setup setup{};
  setup.struct_size = sizeof(setup);
  setup.num_modules = int64_t(names.size());
  setup.modules = names.data();
  setup.hooks = &bridge_->table;
  Communicator* any = comms.tp != nullptr ? comms.tp : comms.cp;
  comms_ =
      std::make_unique<CountedCommunicators>(any != nullptr ? &any->comm_api() : nullptr,
                                             comms.tp != nullptr ? comms.tp->handle() : nullptr,
                                             comms.cp != nullptr ? comms.cp->handle() : nullptr,
                                             comms.ep != nullptr ? comms.ep->handle() : nullptr);
  setup.comm = comms_->api();
  setup.tp = comms_->tp();
  setup.cp = comms_->cp();
  setup.ep = comms_->ep();
  setup.plan_json = plan_json.c_str();
  setup.options_json = options_json.c_str();
  setup.device = device.device;
  setup.compute_stream = device.stream;
  // The collectives a stage on a GPU starts over tp, cp and ep move its
  // memory, ordered with its kernels on the stream it computes on.
  if (device.device.device_type == kDLCUDA) {
    for (Communicator* comm : {comms.tp, comms.cp, comms.ep}) {
      if (comm != nullptr) comm->set_stream(device.stream);
    }
  }
  call("stage_create", [&] { return model.api().stage_create(model.handle(), &setup, &stage_); });
  if (stage_ == nullptr) {
    throw Error(MESHRUN_INTERNAL, fmt::format("model plugin {}: stage_create succeeded but "
                                              "returned no stage",
                                              model.library().path()));
  }
}

ModelStage::~ModelStage() {
  call_plugin(model_.library(), "stage_destroy", [&] { model_.api().stage_destroy(stage_); });
}

template <class Call>
void ModelStage::call(const char* entry_point, Call&& call) const {
  throw_if_error(call_plugin(model_.library(), entry_point, call),
                 fmt::format("model {} {}", model_.library().name(), entry_point));
}

void ModelStage::set_shape(int64_t batch, int64_t seq_len) {
  call("set_shape", [&] {
    return model_.api().set_shape(stage_, batch, seq_len, &input_numel_, &output_numel_);
  });
  batch_ = batch;
  seq_len_ = seq_len;
}

double ModelStage::forward(int32_t microbatch, const int32_t* tokens, const int32_t* targets,
                           const float* input, float* output) {
  int64_t shape[2] = {batch_, seq_len_};
  DLTensor token_tensor{
      const_cast<int32_t*>(tokens), device_.device, 2, dtype_int32(), shape, nullptr, 0};
  DLTensor target_tensor{
      const_cast<int32_t*>(targets), device_.device, 2, dtype_int32(), shape, nullptr, 0};
  FloatArgument in(input, input_numel_, device_.device), out(output, output_numel_, device_.device);
  double loss = 0;
  call("forward", [&] {
    return model_.api().forward(stage_, microbatch, &token_tensor, &target_tensor, in.get(),
                                out.get(), &loss);
  });
  return loss;
}

void ModelStage::backward(int32_t microbatch, float loss_scale, const float* grad_output,
                          float* grad_input) {
  FloatArgument out(grad_output, output_numel_, device_.device),
      in(grad_input, input_numel_, device_.device);
  call("backward",
       [&] { return model_.api().backward(stage_, microbatch, loss_scale, out.get(), in.get()); });
}

void ModelStage::backward_input(int32_t microbatch, float loss_scale, const float* grad_output,
                                float* grad_input) {
  require_split_backward("backward_input");
  FloatArgument out(grad_output, output_numel_, device_.device),
      in(grad_input, input_numel_, device_.device);
  call("backward_input", [&] {
    return model_.api().backward_input(stage_, microbatch, loss_scale, out.get(), in.get());
  });
}

void ModelStage::backward_weight(int32_t microbatch) {
  require_split_backward("backward_weight");
  call("backward_weight", [&] { return model_.api().backward_weight(stage_, microbatch); });
}

void ModelStage::require_split_backward(const char* entry_point) const {
  if (!model_.splits_backward()) {
    throw Error(MESHRUN_UNIMPLEMENTED, fmt::format("model {} cannot split its backward (no {})",
                                                   model_.library().name(), entry_point));
  }
}

void ModelStage::discard(int32_t microbatch) {
  call("discard", [&] { return model_.api().discard(stage_, microbatch); });
}

int64_t ModelStage::activation_bytes() {
  int64_t bytes = 0;
  call("activation_bytes", [&] { return model_.api().activation_bytes(stage_, &bytes); });
  return bytes;
}

std::optional<RouterStatistics> ModelStage::take_router_statistics() {
  const meshrun_model_api& api = model_.api();
  if (!MESHRUN_HAS_FIELD(meshrun_model_api, &api, take_statistics) ||
      api.take_statistics == nullptr) {
    return std::nullopt;
  }
  PluginString text;
  call("take_statistics", [&] { return api.take_statistics(stage_, text.out()); });
  const auto json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("aux_loss") || !json.at("aux_loss").is_number() ||
      !json.contains("expert_tokens") || !json.at("expert_tokens").is_array()) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("model plugin {}: take_statistics wrote '{}', not {{\"aux_loss\": x, "
                            "\"expert_tokens\": [...]}}",
                            model_.library().path(), text.str()));
  }
  return RouterStatistics{json.at("aux_loss").get<double>(),
                          json.at("expert_tokens").get<std::vector<double>>()};
}

}  // namespace meshrun
