// The core's side of the model ABI (meshrun/model.h): a model plugin with
// one configured model and its checked description, and stages of it that
// the trainer drives, whose unit-boundary calls reach C++ StageHooks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "meshrun/model.h"
#include "model/counted_comm.hpp"
#include "plugin/loader.hpp"

namespace meshrun {

struct ModelParameter {
  std::string name;  // Hugging Face name
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the flat parameter layout (description order)
  int32_t unit = 0;    // index into ModelDescription::units
  // How the model computes it over tp ranks: "replicate", "shard(d)" or
  // "shard(d,blocks)" (model/tensor_parallel.hpp).
  std::string tp = "replicate";
  // The mixture-of-experts expert it belongs to, or -1 (a dense parameter).
  int64_t expert = -1;
};

// A module a pipeline split may cut before or after.
struct ModelModule {
  std::string name;
  std::vector<int64_t> parameters;  // indices of the parameters it uses
  std::string group;                // modules of one non-empty group share a stage
};

// Modules the model computes over tp together or replicates together
// (distributed.tp_plan): each module pattern (a parameter's name without
// its last component, '*' for one name component) with its torch style
// when parallel, "colwise" or "rowwise".
struct TensorParallelBlock {
  std::string name;
  std::vector<std::pair<std::string, std::string>> modules;
};

// What a unit holds (the description's "unit_kinds"): a decoder layer, the
// token (and position) embedding, the head (final norm, lm_head), or the
// root, which encloses the others and holds what they share (a tied
// embedding).
enum class UnitKind { layer, embedding, head, root };

// What `describe` said, checked (meshrun/model.h).
struct ModelDescription {
  nlohmann::ordered_json config;  // the Hugging Face config.json
  std::vector<ModelParameter> parameters;
  std::vector<std::string> units;    // the last is "root"
  std::vector<UnitKind> unit_kinds;  // one per unit; without "unit_kinds" all layers but the root
  std::vector<ModelModule> modules;
  int64_t vocab_size = 0;
  std::optional<int64_t> max_seq_len;
  std::string num_layers_key;                // e.g. "model.num_hidden_layers"
  bool sequence_parallel = false;            // the model computes sequence parallelism
  bool tensor_parallel = true;               // the model computes tensor parallelism
  std::vector<std::string> devices{"cpu"};   // where it computes: "cpu", "cuda"
  std::vector<std::string> autocast_dtypes;  // its matmuls' dtypes under autocast
  std::string unit_class;  // the Hugging Face class of its layer units; empty: none named
  // With context parallelism computed: its attention and key/value heads
  // (what Ulysses splits); absent: the model computes no cp.
  struct AttentionHeads {
    int64_t heads = 0, kv_heads = 0;
  };
  std::optional<AttentionHeads> context_parallel;
  // A mixture of experts: experts per layer and per token; absent: dense.
  struct Experts {
    int64_t count = 0, top_k = 0;
  };
  std::optional<Experts> experts;
  // One of the GEMMs a forward runs (flops.gemms, ABI 1.11): rows x k times
  // k x n, `rows` the share of a microbatch's rows it takes (a mixture's
  // expert: top_k / experts), `count` times per forward, with k ("k") or n
  // ("n") divided over tp ranks, or neither (empty).
  struct Gemm {
    int64_t k = 0, n = 0, count = 0;
    double rows = 1.0;
    std::string tp;
  };
  // What a token costs (metrics' flops_per_s and mfu): the weights it meets
  // in matmuls (a mixture of experts: its top_k experts'), and the attention
  // layers with their query width; absent: every parameter, no attention.
  // `gemms`, when described, are those matmuls as the model runs them.
  struct Flops {
    int64_t matmul_parameters = 0, attention_layers = 0, attention_width = 0;
    std::vector<Gemm> gemms;
  };
  std::optional<Flops> flops;
  // What the forward keeps for the backward, in float32 elements per token
  // (row) of a microbatch: `whole` on every tp rank, `tp_split` divided over
  // tp ranks (`meshrun plan --estimate`); absent: not described.
  struct PerToken {
    int64_t whole = 0, tp_split = 0;
  };
  // Of a layer's, the element-wise part's and the head's, those kept in
  // float32 when the matmuls compute in bfloat16 (norm statistics,
  // log-sum-exps, the loss's softmax); the rest is then kept in bfloat16.
  struct KeptInFloat32 {
    PerToken layer, elementwise, head;
  };
  struct Activations {
    PerToken layer;        // one layer, nothing recomputed
    PerToken elementwise;  // the part of `layer` selective checkpointing recomputes
    int64_t stream = 0;    // a layer's input, kept by the stage for every layer (float32)
    PerToken head;         // the head (final norm, logits)
    // Absent: every element is kept in float32 whatever the matmuls' dtype.
    std::optional<KeptInFloat32> float32;
  };
  std::optional<Activations> activations;
  // Empty when the model computes one tensor-parallel layout only.
  std::vector<TensorParallelBlock> tp_blocks;
  int64_t numel = 0;            // elements over all parameters
  nlohmann::ordered_json json;  // as the plugin wrote it (for sidecars)
  // Name -> index, so that reading a description of many layers stays linear.
  std::unordered_map<std::string, int64_t> parameter_indices, module_indices;

  int32_t root_unit() const { return int32_t(units.size()) - 1; }
  bool is_layer_unit(int32_t unit) const { return unit_kinds[size_t(unit)] == UnitKind::layer; }
  // The units but the root in the order a forward runs them: the
  // embedding, the layers as listed, the head.
  std::vector<int32_t> forward_units() const;
  // The index of the parameter called `name`, or -1.
  int64_t parameter_index(const std::string& name) const;
  // The index of the module called `name`, or -1.
  int64_t module_index(const std::string& name) const;
};

// The FLOPs of training on one token of a seq_len-long sequence, forward
// and backward (PaLM's count, as torchtitan's MFU): 6 per weight the token
// meets in a matmul, plus 12 x layers x width x seq_len for attention's two
// matmuls (causal masking not subtracted, activation recomputation not
// added). From the description's "flops"; without it, 6 per parameter.
double flops_per_token(const ModelDescription& description, int64_t seq_len);

// Parses and checks a description; errors name `origin` (the plugin file)
// and the field.
ModelDescription parse_description(const std::string& text, const std::string& origin);

// A model plugin instance with one configured model.
class Model {
 public:
  // Loads nothing: `library` is the model plugin of config.model.model_type.
  // `config` is the [model] table's architecture keys as JSON. Throws
  // INVALID_ARGUMENT naming the key ("model.<key>: ...") for what the plugin
  // refuses; keys outside the plugin's config_keys are refused first.
  Model(std::shared_ptr<PluginLibrary> library, const nlohmann::ordered_json& config);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelDescription& description() const { return description_; }
  const PluginLibrary& library() const { return instance_.library(); }
  meshrun_model* handle() const { return model_; }
  const meshrun_model_api& api() const { return *library().api().model; }
  // The plugin can run backward as separate I and W halves.
  bool splits_backward() const;

  // Writes parameter `parameter`'s initial values (numel floats) for `seed`.
  void init_parameter(uint64_t seed, int64_t parameter, float* values) const;
  // Every parameter in the flat layout (description().numel floats).
  void init_parameters(uint64_t seed, float* values) const;

 private:
  void destroy();

  PluginInstance instance_;
  meshrun_model* model_ = nullptr;
  ModelDescription description_;
};

// The [model] keys a model plugin reads (its table's config_keys).
std::vector<std::string> model_config_keys(const PluginLibrary& library);

// What a stage of some modules holds: the parameters its modules use
// (description indices, ascending) and their units (ascending: the root, if
// held, last). Throws INVALID_ARGUMENT for a module the description lacks.
struct StageContents {
  std::vector<int64_t> parameters;
  std::vector<int32_t> units;
};
StageContents stage_contents(const Model& model, const std::vector<std::string>& modules);

// Where a rank's experts are: expert e of E on ep rank e * size / E.
struct ExpertPlacement {
  int64_t rank = 0, size = 1;
  bool holds(const ModelDescription& description, const ModelParameter& parameter) const {
    return parameter.expert < 0 || !description.experts ||
           parameter.expert * size / description.experts->count == rank;
  }
};
// The contents without the parameters of other ep ranks' experts.
StageContents stage_contents(const Model& model, const std::vector<std::string>& modules,
                             const ExpertPlacement& experts);

// How a strategy numbers a stage's units (meshrun/strategy.h): the units
// the stage holds in forward order, then the root, which the stage's hooks
// enclose the others with when it holds the root, the embedding or the
// head (it may hold no parameter of its own). A stage of layers only has
// no root: its first unit stands for it.
struct StrategyUnitNumbers {
  std::vector<int32_t> of_model_unit;  // per description unit, or -1
  int32_t num_units = 0;
  int32_t root_unit = 0;
};
StrategyUnitNumbers strategy_unit_numbers(const ModelDescription& description,
                                          const std::vector<int32_t>& held_units);

// A parameter's storage as the host hands it to a stage.
struct ParameterStorage {
  float* value = nullptr;
  float* gradient = nullptr;  // null outside a backward
  // The same values in bfloat16 when the strategy gathered them so
  // (meshrun/model.h, parameter_bfloat16), else null.
  const uint16_t* bfloat16 = nullptr;
};

// What a stage calls at unit boundaries (meshrun/model.h, "Hooks"); units
// and parameters are the description's indices. Exceptions thrown here reach
// the plugin as error objects and come back out of the stage's call.
class StageHooks {
 public:
  virtual ~StageHooks() = default;
  // `hidden` (numel floats, or null for the root) may be rewritten in place.
  virtual void pre_forward(int32_t /*unit*/, float* /*hidden*/, int64_t /*numel*/) {}
  virtual void post_forward(int32_t /*unit*/, float* /*hidden*/, int64_t /*numel*/) {}
  virtual void pre_backward(int32_t /*unit*/) {}
  virtual void post_backward(int32_t /*unit*/) {}
  virtual void gradient_ready(int64_t /*parameter*/) {}
  // Storage of a parameter of a unit between its pre_ and post_ hooks;
  // `backward` says whether the gradient is wanted.
  virtual ParameterStorage parameter(int64_t parameter, bool backward) = 0;
};

// What a mixture-of-experts stage's routers added up (meshrun/model.h,
// take_statistics): the micro-batches' load-balancing losses, summed, and
// the slots routed to each expert.
struct RouterStatistics {
  double aux_loss = 0;
  std::vector<double> expert_tokens;
};

// The communicators a stage computes over.
struct StageCommunicators {
  Communicator* tp = nullptr;
  Communicator* cp = nullptr;
  Communicator* ep = nullptr;  // null without an MoE mesh
};

// Where a stage computes (meshrun/model.h, ABI 1.14's setup): every
// pointer handed to its calls (tokens and targets too) and every storage
// the hooks return are memory of `device`; on a CUDA device, `stream` (a
// cudaStream_t, borrowed) is the one they are handed over on: the caller's
// writes are enqueued on it before a call, and the stage's results are
// ready for what the caller enqueues on it after. A stage on a CUDA device
// sets its tp and ep communicators' stream to it.
struct StageDevice {
  DLDevice device{kDLCPU, 0};
  void* stream = nullptr;
};

class ModelStage {
 public:
  // A stage computing `modules` (names from the description) on `device`.
  // `hooks`, `comms`, `model` and `local` must outlive the stage. The
  // parameter views have `local`'s shapes (one tp rank's,
  // model/tensor_parallel.hpp), or the description's when it is null.
  // Throws the plugin's error (a model that cannot compute on `device`
  // refuses it with UNIMPLEMENTED).
  ModelStage(const Model& model, const std::vector<std::string>& modules, StageHooks& hooks,
             const StageCommunicators& comms, const std::string& plan_json,
             const std::string& options_json, const ModelDescription* local = nullptr,
             const StageDevice& device = {});
  ~ModelStage();
  ModelStage(const ModelStage&) = delete;
  ModelStage& operator=(const ModelStage&) = delete;

  const StageContents& contents() const { return contents_; }
  const Model& model() const { return model_; }

  void set_shape(int64_t batch, int64_t seq_len);
  int64_t input_numel() const { return input_numel_; }
  int64_t output_numel() const { return output_numel_; }

  // See meshrun/model.h. tokens and targets are [batch, seq_len].
  double forward(int32_t microbatch, const int32_t* tokens, const int32_t* targets,
                 const float* input, float* output);
  void backward(int32_t microbatch, float loss_scale, const float* grad_output, float* grad_input);
  void backward_input(int32_t microbatch, float loss_scale, const float* grad_output,
                      float* grad_input);
  void backward_weight(int32_t microbatch);
  void discard(int32_t microbatch);
  int64_t activation_bytes();
  // Bytes the model's tensor-parallel communication sent since the last call.
  int64_t take_tensor_parallel_bytes() { return comms_->take_tp_bytes(); }
  // The context-parallel traffic and waits since the last call.
  CommTraffic take_context_parallel_traffic() { return comms_->take_cp_traffic(); }
  // The expert-parallel traffic (dispatch and combine) and waits since the
  // last call.
  CommTraffic take_expert_parallel_traffic() { return comms_->take_ep_traffic(); }
  // The router statistics since the last call; none from a model without
  // experts.
  std::optional<RouterStatistics> take_router_statistics();

 private:
  struct Bridge;
  // Runs `call` (a call of the plugin's `entry_point`) and throws its error.
  template <class Call>
  void call(const char* entry_point, Call&& call) const;
  void require_split_backward(const char* entry_point) const;

  const Model& model_;
  StageDevice device_;
  StageContents contents_;
  std::unique_ptr<Bridge> bridge_;
  std::unique_ptr<CountedCommunicators> comms_;
  meshrun_model_stage* stage_ = nullptr;
  int64_t batch_ = 0, seq_len_ = 0, input_numel_ = 0, output_numel_ = 0;
};

}  // namespace meshrun
