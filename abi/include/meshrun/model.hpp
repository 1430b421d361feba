// meshrun/model.hpp — header-only C++ helper for model plugin authors
// (meshrun/model.h).
//
// Turns two C++ classes into the model table: exceptions become error
// objects (std::invalid_argument INVALID_ARGUMENT, std::out_of_range
// OUT_OF_RANGE, other std::logic_error — a call out of order —
// FAILED_PRECONDITION, the rest as guard() says), a hook's error goes back to
// the host unchanged, NULL arguments are refused. Nothing here needs
// libmeshrun.
//
//   struct MyModel {
//     MyModel(const meshrun_host_services& host, const char* config_json);
//     const meshrun_host_services& host() const;
//     std::string describe() const;                        // the JSON description
//     void init_parameter(uint64_t seed, int64_t parameter, float* values) const;
//   };
//   struct MyStage {
//     MyStage(MyModel& model, const meshrun_model_stage_setup& setup);
//     void set_shape(int64_t batch, int64_t seq_len, int64_t* input_numel,
//                    int64_t* output_numel);
//     double forward(int32_t mb, const int32_t* tokens, const int32_t* targets,
//                    const float* input, float* output);
//     void backward(int32_t mb, float loss_scale, const float* grad_output, float* grad_input);
//     void backward_input(...);  void backward_weight(int32_t mb);  // optional
//     void discard(int32_t mb);
//     int64_t activation_bytes() const;
//     std::string take_statistics();   // optional: a mixture of experts' (model.h)
//     const meshrun_host_services& host() const;  // with take_statistics
//     static constexpr bool kComputesOnCuda = true;  // optional: else CPU only
//   };
//   static const meshrun_model_api model_api =
//       meshrun::plugin::ModelTable<MyModel, MyStage>::make("my_type", keys);
//
// The table's backward_input and backward_weight are set when MyStage has
// both (a split backward for zero-bubble schedules), else NULL; its
// model_create when MyModel is made from (host, config_json), else the
// caller sets it (the model kit's plugins make theirs from a composition).
//
// The table refuses a stage setup on a device the Stage does not compute on
// (UNIMPLEMENTED), and a tensor handed to the stage on another device than
// the setup's (INVALID_ARGUMENT naming both); the Stage reads the device
// from its setup (stage_device) to place its own buffers.
//
// A stage reaches the host through ModelHooks, whose calls throw HostError.
#ifndef MESHRUN_MODEL_HPP_
#define MESHRUN_MODEL_HPP_

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "meshrun/model.h"
#include "meshrun/plugin.hpp"

namespace meshrun::plugin {

// The data of a compact tensor the host passed, or NULL when there is none.
template <class T>
T* data_of(const DLTensor* tensor) {
  if (tensor == nullptr || tensor->data == nullptr) return nullptr;
  return reinterpret_cast<T*>(static_cast<char*>(tensor->data) + tensor->byte_offset);
}

// Where a stage computes (meshrun_model_stage_setup.device, ABI 1.14): the
// CPU when the host's setup predates it.
inline DLDevice stage_device(const meshrun_model_stage_setup& setup) {
  if (setup.struct_size < MESHRUN_MODEL_STAGE_SETUP_SIZE_1_14) return DLDevice{kDLCPU, 0};
  return setup.device;
}

// "cpu", "cuda:0", ... for messages.
inline std::string device_name(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost:
      return "cuda_host";
    default:
      return "device type " + std::to_string(int(device.device_type)) + ":" +
             std::to_string(device.device_id);
  }
}

// Whether memory on `device` is memory on `stage` (the CPU's has one id).
inline bool same_device(DLDevice device, DLDevice stage) {
  return device.device_type == stage.device_type &&
         (device.device_type == kDLCPU || device.device_id == stage.device_id);
}

// The data of a tensor the host handed a stage on `device`, or NULL when
// there is none; std::invalid_argument naming `what` and both devices when
// it lies elsewhere.
template <class T>
T* data_on(DLDevice device, const DLTensor* tensor, const char* what) {
  T* data = data_of<T>(tensor);
  if (data != nullptr && !same_device(tensor->device, device)) {
    throw std::invalid_argument(std::string(what) + " is on " + device_name(tensor->device) +
                                ", and the stage computes on " + device_name(device));
  }
  return data;
}

// The host's hooks (meshrun/model.h) as C++ calls; each throws HostError
// carrying the host's error object.
class ModelHooks {
 public:
  // The hooks of a stage on `device`: the hidden states it shows them are
  // there, and the parameter views they hand back must be.
  explicit ModelHooks(const meshrun_model_hooks& hooks, DLDevice device = DLDevice{kDLCPU, 0})
      : hooks_(&hooks), device_(device) {}

  void pre_forward(int32_t unit, float* hidden, int64_t numel) const {
    DLTensor tensor = float_tensor(hidden, &numel);
    check(hooks_->pre_forward(hooks_->context, unit, hidden != nullptr ? &tensor : nullptr));
  }
  void post_forward(int32_t unit, float* hidden, int64_t numel) const {
    DLTensor tensor = float_tensor(hidden, &numel);
    check(hooks_->post_forward(hooks_->context, unit, hidden != nullptr ? &tensor : nullptr));
  }
  void pre_backward(int32_t unit) const { check(hooks_->pre_backward(hooks_->context, unit)); }
  void post_backward(int32_t unit) const { check(hooks_->post_backward(hooks_->context, unit)); }
  void gradient_ready(int64_t parameter) const {
    check(hooks_->gradient_ready(hooks_->context, parameter));
  }
  // The parameter's values and (in a backward, else NULL) gradient.
  std::pair<float*, float*> parameter(int64_t parameter) const {
    DLTensor value{};
    DLTensor gradient{};
    check(hooks_->parameter(hooks_->context, parameter, &value, &gradient));
    return {data_on<float>(device_, &value, "a parameter's values"),
            data_on<float>(device_, &gradient, "a parameter's gradient")};
  }
  // The parameter's bfloat16 values when the host holds them (ABI 1.12),
  // else NULL.
  const uint16_t* parameter_bfloat16(int64_t parameter) const {
    if (hooks_->struct_size < MESHRUN_MODEL_HOOKS_SIZE_1_12 ||
        hooks_->parameter_bfloat16 == nullptr) {
      return nullptr;
    }
    DLTensor value{};
    check(hooks_->parameter_bfloat16(hooks_->context, parameter, &value));
    return data_on<const uint16_t>(device_, &value, "a parameter's bfloat16 values");
  }

 private:
  DLTensor float_tensor(float* data, int64_t* numel) const {
    return DLTensor{data, device_, 1, {kDLFloat, 32, 1}, numel, nullptr, 0};
  }
  static void check(meshrun_error* error) {
    if (error != nullptr) throw HostError(error);
  }
  const meshrun_model_hooks* hooks_;
  DLDevice device_;
};

// `text` in memory from the host's `allocate`, as describe returns it.
inline char* host_string(const meshrun_host_services& host, const std::string& text) {
  auto* copy = static_cast<char*>(host.allocate(host.context, text.size() + 1, 1));
  if (copy == nullptr) throw Error(MESHRUN_INTERNAL, "out of memory");
  std::memcpy(copy, text.c_str(), text.size() + 1);
  return copy;
}

namespace detail {
// Whether a Stage class has backward_input and backward_weight (C++17).
template <class Stage, class = void>
struct SplitsBackward : std::false_type {};
template <class Stage>
struct SplitsBackward<
    Stage, std::void_t<decltype(std::declval<Stage&>().backward_input(0, 1.0f, nullptr, nullptr)),
                       decltype(std::declval<Stage&>().backward_weight(0))>> : std::true_type {};
// Whether a Stage class computes on CUDA GPUs too (static constexpr bool
// kComputesOnCuda = true); else on the CPU only.
template <class Stage, class = void>
struct ComputesOnCuda : std::false_type {};
template <class Stage>
struct ComputesOnCuda<Stage, std::enable_if_t<Stage::kComputesOnCuda>> : std::true_type {};
template <class Stage, class = void>
struct ReportsStatistics : std::false_type {};
template <class Stage>
struct ReportsStatistics<Stage, std::void_t<decltype(std::declval<Stage&>().take_statistics())>>
    : std::true_type {};
}  // namespace detail

// The model table for the classes Model and Stage described at the top;
// the plugin instance must be a HostServicesOnly (create_instance<>).
template <class Model, class Stage>
class ModelTable {
 public:
  static meshrun_model_api make(const char* model_type, const char* const* config_keys) {
    meshrun_model_api api{};
    api.struct_size = sizeof(meshrun_model_api);
    api.model_type = model_type;
    api.config_keys = config_keys;
    if constexpr (kMadeFromConfig) api.model_create = &model_create;
    api.model_destroy = &model_destroy;
    api.describe = &describe;
    api.init_parameter = &init_parameter;
    api.stage_create = &stage_create;
    api.stage_destroy = &stage_destroy;
    api.set_shape = &set_shape;
    api.forward = &forward;
    api.backward = &backward;
    if constexpr (kSplitsBackward) {
      api.backward_input = &backward_input;
      api.backward_weight = &backward_weight;
    }
    api.discard = &discard;
    api.activation_bytes = &activation_bytes;
    if constexpr (kReportsStatistics) api.take_statistics = &take_statistics;
    return api;
  }

 private:
  static constexpr bool kMadeFromConfig =
      std::is_constructible_v<Model, const meshrun_host_services&, const char*>;
  static constexpr bool kSplitsBackward = detail::SplitsBackward<Stage>::value;
  static constexpr bool kReportsStatistics = detail::ReportsStatistics<Stage>::value;

  template <class Body>
  static meshrun_error* guard(Body&& body) noexcept {
    return plugin::guard([&] {
      try {
        body();
      } catch (const std::invalid_argument& e) {
        throw Error(MESHRUN_INVALID_ARGUMENT, e.what());
      } catch (const std::out_of_range& e) {
        throw Error(MESHRUN_OUT_OF_RANGE, e.what());
      } catch (const std::logic_error& e) {
        throw Error(MESHRUN_FAILED_PRECONDITION, e.what());
      }
    });
  }
  static void require(bool condition, const char* what) {
    if (!condition) throw Error(MESHRUN_INVALID_ARGUMENT, std::string(what) + " is NULL");
  }
  static Model& model_of(meshrun_model* model) {
    require(model != nullptr, "model");
    return *reinterpret_cast<Model*>(model);
  }
  // A stage and the device it computes on, which every tensor handed to it
  // must be on.
  struct Held {
    Held(Model& model, const meshrun_model_stage_setup& setup)
        : device(stage_device(setup)), stage(model, setup) {}
    DLDevice device;
    Stage stage;
  };
  static Held& held_of(meshrun_model_stage* stage) {
    require(stage != nullptr, "stage");
    return *reinterpret_cast<Held*>(stage);
  }
  static Stage& stage_of(meshrun_model_stage* stage) { return held_of(stage).stage; }

  static meshrun_error* model_create(meshrun_plugin_instance* instance, const char* config_json,
                                     meshrun_model** out) {
    return guard([&] {
      require(instance != nullptr && config_json != nullptr && out != nullptr,
              "model_create: instance, config_json or out");
      const auto& host = reinterpret_cast<HostServicesOnly*>(instance)->host();
      *out = reinterpret_cast<meshrun_model*>(new Model(host, config_json));
    });
  }
  static void model_destroy(meshrun_model* model) { delete reinterpret_cast<Model*>(model); }
  static meshrun_error* describe(meshrun_model* model, char** out_json) {
    return guard([&] {
      require(out_json != nullptr, "describe: out_json");
      const Model& m = model_of(model);
      *out_json = host_string(m.host(), m.describe());
    });
  }
  static meshrun_error* init_parameter(meshrun_model* model, uint64_t seed, int64_t parameter,
                                       DLTensor* value) {
    return guard([&] {
      require(value != nullptr && value->data != nullptr, "init_parameter: value");
      model_of(model).init_parameter(seed, parameter, data_of<float>(value));
    });
  }
  static meshrun_error* stage_create(meshrun_model* model, const meshrun_model_stage_setup* setup,
                                     meshrun_model_stage** out) {
    return guard([&] {
      require(setup != nullptr && out != nullptr, "stage_create: setup or out");
      require(setup->hooks != nullptr, "stage_create: setup->hooks");
      if (setup->struct_size < MESHRUN_MODEL_STAGE_SETUP_SIZE_1_5 ||
          setup->hooks->struct_size < MESHRUN_MODEL_HOOKS_SIZE_1_5) {
        throw Error(MESHRUN_INVALID_ARGUMENT, "stage_create: setup or hooks table too small");
      }
      const DLDevice device = stage_device(*setup);
      const bool cuda = device.device_type == kDLCUDA && detail::ComputesOnCuda<Stage>::value;
      if (device.device_type != kDLCPU && !cuda) {
        throw Error(MESHRUN_UNIMPLEMENTED,
                    "stage_create: the stage setup's device is " + device_name(device) +
                        ", and this model computes on the CPU" +
                        (detail::ComputesOnCuda<Stage>::value ? " and CUDA GPUs" : " only"));
      }
      *out = reinterpret_cast<meshrun_model_stage*>(new Held(model_of(model), *setup));
    });
  }
  static void stage_destroy(meshrun_model_stage* stage) { delete reinterpret_cast<Held*>(stage); }
  static meshrun_error* set_shape(meshrun_model_stage* stage, int64_t batch, int64_t seq_len,
                                  int64_t* out_input_numel, int64_t* out_output_numel) {
    return guard([&] {
      require(out_input_numel != nullptr && out_output_numel != nullptr, "set_shape: outputs");
      stage_of(stage).set_shape(batch, seq_len, out_input_numel, out_output_numel);
    });
  }
  static meshrun_error* forward(meshrun_model_stage* stage, int32_t microbatch,
                                const DLTensor* tokens, const DLTensor* targets,
                                const DLTensor* input, DLTensor* output, double* out_loss) {
    return guard([&] {
      require(out_loss != nullptr, "forward: out_loss");
      Held& held = held_of(stage);
      const DLDevice on = held.device;
      *out_loss =
          held.stage.forward(microbatch, data_on<const int32_t>(on, tokens, "forward: tokens"),
                             data_on<const int32_t>(on, targets, "forward: targets"),
                             data_on<const float>(on, input, "forward: input"),
                             data_on<float>(on, output, "forward: output"));
    });
  }
  static meshrun_error* backward(meshrun_model_stage* stage, int32_t microbatch, float loss_scale,
                                 const DLTensor* grad_output, DLTensor* grad_input) {
    return guard([&] {
      Held& held = held_of(stage);
      held.stage.backward(microbatch, loss_scale,
                          data_on<const float>(held.device, grad_output, "backward: grad_output"),
                          data_on<float>(held.device, grad_input, "backward: grad_input"));
    });
  }
  static meshrun_error* backward_input(meshrun_model_stage* stage, int32_t microbatch,
                                       float loss_scale, const DLTensor* grad_output,
                                       DLTensor* grad_input) {
    return guard([&] {
      Held& held = held_of(stage);
      held.stage.backward_input(
          microbatch, loss_scale,
          data_on<const float>(held.device, grad_output, "backward_input: grad_output"),
          data_on<float>(held.device, grad_input, "backward_input: grad_input"));
    });
  }
  static meshrun_error* backward_weight(meshrun_model_stage* stage, int32_t microbatch) {
    return guard([&] { stage_of(stage).backward_weight(microbatch); });
  }
  static meshrun_error* discard(meshrun_model_stage* stage, int32_t microbatch) {
    return guard([&] { stage_of(stage).discard(microbatch); });
  }
  static meshrun_error* activation_bytes(meshrun_model_stage* stage, int64_t* out_bytes) {
    return guard([&] {
      require(out_bytes != nullptr, "activation_bytes: out_bytes");
      *out_bytes = stage_of(stage).activation_bytes();
    });
  }
  static meshrun_error* take_statistics(meshrun_model_stage* stage, char** out_json) {
    return guard([&] {
      require(out_json != nullptr, "take_statistics: out_json");
      Stage& s = stage_of(stage);
      *out_json = host_string(s.host(), s.take_statistics());
    });
  }
};

}  // namespace meshrun::plugin

#endif  // MESHRUN_MODEL_HPP_
