// The model ABI's classes (meshrun/model.hpp's ModelTable) for a shipped
// family, made of a Plugin struct in the family's plugin.cpp that holds
//   Family: the family's compute (common/stage.hpp)
//   read_config(config_json) -> Family::Config: the [model] keys, checked
//   describe(config, parameters) -> the description JSON
//   modules(config) -> ModelModules
// Header-only: it is compiled into each model plugin, which alone links the
// ABI headers.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/compute.hpp"
#include "common/context_parallel.hpp"
#include "common/description.hpp"
#include "common/expert_parallel.hpp"
#include "common/stage.hpp"
#include "meshrun/model.hpp"

namespace meshrun::models {

// The host's hooks, as a stage calls them.
class HostHooks : public StageHooks {
 public:
  // The hooks of a stage on `device` (meshrun/model.h, ABI 1.14).
  HostHooks(const meshrun_model_hooks& hooks, DLDevice device) : hooks_(hooks, device) {}
  void pre_forward(int64_t unit, float* hidden, int64_t numel) override {
    hooks_.pre_forward(int32_t(unit), hidden, numel);
  }
  void post_forward(int64_t unit, float* hidden, int64_t numel) override {
    hooks_.post_forward(int32_t(unit), hidden, numel);
  }
  void pre_backward(int64_t unit) override { hooks_.pre_backward(int32_t(unit)); }
  void post_backward(int64_t unit) override { hooks_.post_backward(int32_t(unit)); }
  void gradient_ready(int64_t parameter) override { hooks_.gradient_ready(parameter); }
  void bind(ParameterView& view, bool backward) override {
    const auto [values, gradient] = hooks_.parameter(view.index);
    view.data = values;
    view.grad = backward ? gradient : nullptr;
    view.bfloat16 = hooks_.parameter_bfloat16(view.index);
  }

 private:
  plugin::ModelHooks hooks_;
};

// A communicator of the stage (meshrun_model_stage_setup.tp, .cp or .ep)
// through the comm backend's table; one rank without it. The tensors it
// hands the backend are on `device` (the stage's, or the host's for what
// the stage keeps in host memory). A failed operation (a peer gone past
// the timeout) throws the backend's error object, which the stage hands
// back to the host unchanged.
class HostCommunicator {
 public:
  HostCommunicator(const meshrun_comm_api* api, meshrun_communicator* comm, DLDevice device)
      : api_(api), comm_(comm), device_(device) {
    if (api_ == nullptr || comm_ == nullptr) return;
    check(api_->rank(comm_, &rank_));
    check(api_->size(comm_, &size_));
  }
  int64_t size() const { return size_; }
  int64_t rank() const { return rank_; }
  // A float32 vector as DLPack describes it; the backend reads the
  // description when the operation starts.
  struct Tensor {
    Tensor(const float* data, int64_t count, DLDevice device)
        : shape{count},
          tensor{const_cast<float*>(data), device, 1, {kDLFloat, 32, 1}, shape, nullptr, 0} {}
    int64_t shape[1];
    DLTensor tensor;
  };
  meshrun_request* start_all_reduce(float* data, int64_t count, int32_t op) {
    Tensor tensor(data, count, device_);
    meshrun_request* request = nullptr;
    check(api_->all_reduce(comm_, &tensor.tensor, &tensor.tensor, op, &request));
    return request;
  }
  meshrun_request* start_all_gather(const float* send, float* recv, int64_t count) {
    Tensor in(send, count, device_), out(recv, count * size_, device_);
    meshrun_request* request = nullptr;
    check(api_->all_gather(comm_, &in.tensor, &out.tensor, &request));
    return request;
  }
  meshrun_request* start_reduce_scatter(const float* send, float* recv, int64_t count) {
    Tensor in(send, count * size_, device_), out(recv, count, device_);
    meshrun_request* request = nullptr;
    check(api_->reduce_scatter(comm_, &in.tensor, &out.tensor, MESHRUN_REDUCE_SUM, &request));
    return request;
  }
  meshrun_request* start_send(const float* data, int64_t count, int64_t peer, int64_t tag) {
    Tensor tensor(data, count, device_);
    meshrun_request* request = nullptr;
    check(api_->send(comm_, &tensor.tensor, peer, tag, &request));
    return request;
  }
  meshrun_request* start_recv(float* data, int64_t count, int64_t peer, int64_t tag) {
    Tensor tensor(data, count, device_);
    meshrun_request* request = nullptr;
    check(api_->recv(comm_, &tensor.tensor, peer, tag, &request));
    return request;
  }
  // Only with an ABI 1.7 backend; UNIMPLEMENTED with an older one.
  meshrun_request* start_all_to_all(const float* send, const std::vector<int64_t>& send_counts,
                                    float* recv, const std::vector<int64_t>& recv_counts) {
    if (!MESHRUN_HAS_FIELD(meshrun_comm_api, api_, all_to_all) || api_->all_to_all == nullptr) {
      throw plugin::Error(MESHRUN_UNIMPLEMENTED,
                          "expert and context parallelism need the comm backend's all_to_all "
                          "(ABI 1.7)");
    }
    int64_t sent = 0, received = 0;
    for (const int64_t count : send_counts) sent += count;
    for (const int64_t count : recv_counts) received += count;
    Tensor in(send, sent, device_), out(recv, received, device_);
    meshrun_request* request = nullptr;
    check(api_->all_to_all(comm_, &in.tensor, send_counts.data(), &out.tensor, recv_counts.data(),
                           &request));
    return request;
  }
  void finish(meshrun_request* request) {
    meshrun_error* error = api_->wait(request, -1.0);
    api_->request_destroy(request);
    check(error);
  }
  // Completes every request in `started`, which it empties.
  void finish_all(std::vector<meshrun_request*>& started) {
    std::vector<meshrun_request*> requests;
    requests.swap(started);
    for (meshrun_request* request : requests) finish(request);
  }

 private:
  static void check(meshrun_error* error) {
    if (error != nullptr) throw plugin::HostError(error);
  }

  const meshrun_comm_api* api_;
  meshrun_communicator* comm_;
  DLDevice device_;
  int64_t rank_ = 0, size_ = 1;
};

// The stage's tp group.
class HostTensorParallelGroup : public TensorParallelGroup {
 public:
  // `async`: start_* return before their collective completes.
  HostTensorParallelGroup(const meshrun_model_stage_setup& setup, bool async)
      : comm_(setup.comm, setup.tp, plugin::stage_device(setup)), async_(async) {}
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void all_reduce_sum(float* data, int64_t count) override {
    comm_.finish(comm_.start_all_reduce(data, count, MESHRUN_REDUCE_SUM));
  }
  void all_reduce_max(float* data, int64_t count) override {
    comm_.finish(comm_.start_all_reduce(data, count, MESHRUN_REDUCE_MAX));
  }
  void all_gather(const float* send, float* recv, int64_t count) override {
    comm_.finish(comm_.start_all_gather(send, recv, count));
  }
  void reduce_scatter_sum(const float* send, float* recv, int64_t count) override {
    comm_.finish(comm_.start_reduce_scatter(send, recv, count));
  }
  void start_all_reduce_sum(float* data, int64_t count) override {
    if (!async_) return all_reduce_sum(data, count);
    started_.push_back(comm_.start_all_reduce(data, count, MESHRUN_REDUCE_SUM));
  }
  void start_reduce_scatter_sum(const float* send, float* recv, int64_t count) override {
    if (!async_) return reduce_scatter_sum(send, recv, count);
    started_.push_back(comm_.start_reduce_scatter(send, recv, count));
  }
  void wait_started() override { comm_.finish_all(started_); }

 private:
  HostCommunicator comm_;
  bool async_;
  std::vector<meshrun_request*> started_;  // by start_*, until wait_started
};

// The stage's cp group, on the stage's device: ring and Ulysses attention
// (common/context_parallel.hpp) and the loss's sum move its memory.
class HostContextParallelGroup : public ContextParallelGroup {
 public:
  explicit HostContextParallelGroup(const meshrun_model_stage_setup& setup)
      : comm_(setup.comm, setup.cp, plugin::stage_device(setup)) {}
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void all_reduce_sum(float* data, int64_t count) override {
    comm_.finish(comm_.start_all_reduce(data, count, MESHRUN_REDUCE_SUM));
  }
  void start_all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                        const std::vector<int64_t>& recv_counts) override {
    started_.push_back(comm_.start_all_to_all(send, send_counts, recv, recv_counts));
  }
  void wait_started() override { comm_.finish_all(started_); }

 private:
  HostCommunicator comm_;
  std::vector<meshrun_request*> started_;
};

// The stage's ep group.
class HostExpertParallelGroup : public ExpertParallelGroup {
 public:
  explicit HostExpertParallelGroup(const meshrun_model_stage_setup& setup)
      : comm_(setup.comm, setup.ep, plugin::stage_device(setup)) {}
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts) override {
    comm_.finish(comm_.start_all_to_all(send, send_counts, recv, recv_counts));
  }

 private:
  HostCommunicator comm_;
};

template <class Plugin>
class HostModel {
 public:
  using Family = typename Plugin::Family;
  using Config = typename Family::Config;

  HostModel(const meshrun_host_services& host, const char* config_json) requires requires {
    Plugin::read_config(config_json);
  } : HostModel(host, Plugin::read_config(config_json)) {
  }
  HostModel(const meshrun_host_services& host, Config config)
      : host_(host), config_(std::move(config)), parameters_(Family::parameters(config_)) {}

  const meshrun_host_services& host() const { return host_; }
  const Config& config() const { return config_; }
  std::string describe() const { return Plugin::describe(config_, parameters_); }

  void init_parameter(uint64_t seed, int64_t parameter, float* values) const {
    if (parameter < 0 || parameter >= int64_t(parameters_.size())) {
      throw plugin::Error(MESHRUN_OUT_OF_RANGE, std::string(Family::kName) +
                                                    ": init_parameter: no parameter " +
                                                    std::to_string(parameter));
    }
    Family::init_parameter(config_, parameters_, seed, parameter, values);
  }

  // The layout of a stage of the setup's modules (a contiguous run of the
  // description's, which the host checked).
  StageLayout layout_of(const meshrun_model_stage_setup& setup) const {
    std::vector<std::string> names;
    for (int64_t m = 0; m < setup.num_modules; ++m) {
      names.emplace_back(setup.modules[m] != nullptr ? setup.modules[m] : "");
    }
    return stage_layout(Plugin::modules(config_), Family::num_layers(config_), names,
                        Family::kName);
  }
  Checkpointing checkpointed_layers(const meshrun_model_stage_setup& setup) const {
    return models::checkpointed_layers(Plugin::modules(config_), Family::num_layers(config_),
                                       setup.plan_json, Family::kName);
  }

 private:
  const meshrun_host_services& host_;
  Config config_;
  std::vector<ParameterView> parameters_;
};

template <class Plugin>
class HostStage {
 public:
  // A Plugin with make_compute(setup) -> std::unique_ptr<Compute> computes
  // on CUDA devices too: it makes the compute of a setup's device other
  // than the CPU (throwing plugin::Error when it cannot), where the stage
  // then keeps its buffers and computes; else the stage computes on the
  // host's.
  static constexpr bool kComputesOnCuda = requires(const meshrun_model_stage_setup& setup) {
    Plugin::make_compute(setup);
  };

  HostStage(HostModel<Plugin>& model, const meshrun_model_stage_setup& setup)
      : HostStage(model, setup, plan_placements(setup.plan_json)) {}

  void set_shape(int64_t batch, int64_t seq_len, int64_t* input_numel, int64_t* output_numel) {
    stage_.set_shape(batch, seq_len);
    *input_numel = stage_.input_numel();
    *output_numel = stage_.output_numel();
  }
  // Each computing call runs its matmuls in the plan's autocast precision.
  double forward(int32_t mb, const int32_t* tokens, const int32_t* targets, const float* input,
                 float* output) {
    kernels::MatmulPrecisionScope precision(matmul_precision_);
    return stage_.forward(mb, tokens, targets, input, output);
  }
  void backward(int32_t mb, float loss_scale, const float* grad_output, float* grad_input) {
    kernels::MatmulPrecisionScope precision(matmul_precision_);
    stage_.backward(mb, loss_scale, grad_output, grad_input);
  }
  void backward_input(int32_t mb, float loss_scale, const float* grad_output, float* grad_input) {
    kernels::MatmulPrecisionScope precision(matmul_precision_);
    stage_.backward_input(mb, loss_scale, grad_output, grad_input);
  }
  void backward_weight(int32_t mb) {
    kernels::MatmulPrecisionScope precision(matmul_precision_);
    stage_.backward_weight(mb);
  }
  void discard(int32_t mb) { stage_.discard(mb); }
  int64_t activation_bytes() const { return stage_.activation_bytes(); }
  // A mixture of experts' router statistics (meshrun/model.h), which start
  // again.
  std::string take_statistics() requires(requires { Plugin::Family::kExperts; }) {
    const ExpertStatistics taken = std::exchange(statistics_, {});
    return nlohmann::json{{"aux_loss", taken.aux_loss}, {"expert_tokens", taken.expert_tokens}}
        .dump();
  }
  const meshrun_host_services& host() const { return host_; }

 private:
  HostStage(HostModel<Plugin>& model, const meshrun_model_stage_setup& setup,
            const Placements& placements)
      : host_(model.host()),
        own_compute_(device_compute(setup)),
        hooks_(*setup.hooks, plugin::stage_device(setup)),
        matmul_precision_(planned_matmul_precision(setup.plan_json, Plugin::Family::kName)),
        tp_(setup, placements.async),
        cp_group_(setup),
        ep_group_(setup),
        stage_(model.config(), model.layout_of(setup), hooks_, model.checkpointed_layers(setup),
               &tp_, placements,
               plan_context_parallel(setup.plan_json, &cp_group_, Plugin::Family::kName),
               ExpertParallel{setup.ep != nullptr ? &ep_group_ : nullptr, &statistics_},
               matmul_precision_ == kernels::MatmulPrecision::bfloat16,
               own_compute_ ? *own_compute_ : host_compute()) {}

  static std::unique_ptr<Compute> device_compute(const meshrun_model_stage_setup& setup) {
    if constexpr (kComputesOnCuda) {
      if (plugin::stage_device(setup).device_type != kDLCPU) return Plugin::make_compute(setup);
    }
    return nullptr;
  }

  const meshrun_host_services& host_;
  // The compute of the setup's device; none on the CPU (the host's).
  std::unique_ptr<Compute> own_compute_;
  HostHooks hooks_;
  // The plan's autocast precision: bfloat16 matmuls keep bfloat16 activations.
  kernels::MatmulPrecision matmul_precision_;
  HostTensorParallelGroup tp_;
  HostContextParallelGroup cp_group_;
  HostExpertParallelGroup ep_group_;
  ExpertStatistics statistics_;
  TransformerStage<typename Plugin::Family> stage_;
};

// The plugin table of a shipped model plugin, over its model table.
inline meshrun_plugin_api model_plugin_api(const char* name, const char* version,
                                           const char* description,
                                           const meshrun_model_api* model) {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_MODEL;
  api.name = name;
  api.version = version;
  api.description = description;
  api.create = &plugin::create_instance<plugin::HostServicesOnly>;
  api.destroy = &plugin::destroy_instance<plugin::HostServicesOnly>;
  api.model = model;
  return api;
}

}  // namespace meshrun::models
