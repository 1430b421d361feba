#include "kit/composition.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "common/mixture_of_experts.hpp"

namespace meshrun::kit {

using models::add_parameter;
using models::Block;
using models::DecoderUnits;
using nlohmann::ordered_json;

namespace {

const char* op_name(Op op) {
  switch (op) {
    case Op::rmsnorm:
      return "RMSNORM";
    case Op::layernorm:
      return "LAYERNORM";
    case Op::attention:
      return "ATTENTION";
    case Op::swiglu_mlp:
      return "SWIGLU_MLP";
    case Op::gelu_mlp:
      return "GELU_MLP";
    case Op::add:
      return "ADD";
    case Op::moe_mlp:
      return "MOE_MLP";
  }
  return "?";
}

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

std::string text(const char* value, const char* fallback) {
  return value != nullptr && *value != '\0' ? value : fallback;
}

// Messages about op `index` of the layer begin with where it is.
struct OpChecker {
  const meshrun_kit_op& spec;
  int64_t index;

  std::string where() const {
    return "kit: layer op " + std::to_string(index) +
           (spec.name != nullptr ? " '" + std::string(spec.name) + "'" : std::string(" (ADD)"));
  }
  void require(bool condition, const std::string& message) const {
    if (!condition) throw std::invalid_argument(where() + " " + message);
  }
  // The number of tensor `name`, which must be written already.
  int read(const char* name, const std::vector<std::string>& tensors) const {
    require(name != nullptr, "reads no tensor (input is NULL)");
    const auto found = std::find(tensors.begin(), tensors.end(), name);
    std::string known;
    for (const std::string& tensor : tensors) known += (known.empty() ? "" : ", ") + tensor;
    require(found != tensors.end(), "reads '" + std::string(name) +
                                        "', which no earlier op writes (written so far: " + known +
                                        ")");
    return int(found - tensors.begin());
  }
};

LayerOp checked_op(const meshrun_kit_op& spec, int64_t index, std::vector<std::string>& tensors,
                   const std::vector<LayerOp>& earlier) {
  const OpChecker check{spec, index};
  check.require(
      spec.op >= MESHRUN_KIT_RMSNORM && spec.op <= MESHRUN_KIT_MOE_MLP,
      "has op " + std::to_string(spec.op) +
          "; valid: MESHRUN_KIT_RMSNORM, LAYERNORM, ATTENTION, SWIGLU_MLP, GELU_MLP, ADD, MOE_MLP");
  LayerOp op{Op(spec.op), spec.name != nullptr ? spec.name : ""};
  const bool add = op.op == Op::add;
  check.require(add || !op.name.empty(),
                "is a " + std::string(op_name(op.op)) + " without a name (its parameters' module)");
  check.require(
      op.name.find_first_not_of("abcdefghijklmnopqrstuvwxyz"
                                "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.") == std::string::npos,
      "has a name that is not [A-Za-z0-9_.]+");
  for (const LayerOp& other : earlier) {
    check.require(op.name.empty() || other.name != op.name,
                  "has the name of an earlier op: their parameters would collide");
  }
  const bool projects = op.op == Op::attention || is_mlp(op.op);
  check.require(
      spec.flags == 0 || (projects && (spec.flags & ~3) == 0),
      "has flags " + std::to_string(spec.flags) +
          "; only ATTENTION, SWIGLU_MLP and GELU_MLP take MESHRUN_KIT_BIAS_IN | BIAS_OUT");
  op.bias_in = (spec.flags & MESHRUN_KIT_BIAS_IN) != 0;
  op.bias_out = (spec.flags & MESHRUN_KIT_BIAS_OUT) != 0;
  op.input = check.read(spec.input, tensors);
  check.require(add == (spec.input2 != nullptr),
                add ? "is an ADD without input2" : "has an input2, which only ADD reads");
  if (add) op.input2 = check.read(spec.input2, tensors);
  check.require(spec.output != nullptr, "writes no tensor (output is NULL)");
  const std::string output = spec.output;
  check.require(std::find(tensors.begin(), tensors.end(), output) == tensors.end(),
                "writes '" + output + "', which is written already: each op writes a new tensor");
  op.output = int(tensors.size());
  tensors.push_back(output);
  return op;
}

// Empty when every attention and MLP input is a norm's output that only
// attention and MLPs read; else why not.
std::string sequence_parallel_refusal(const std::vector<LayerOp>& ops) {
  for (const LayerOp& op : ops) {
    if (op.op == Op::moe_mlp) {
      return "layer op '" + op.name + "' is a MOE_MLP, which computes whole on each tp rank";
    }
  }
  const auto projects = [](Op op) { return op == Op::attention || is_mlp(op); };
  for (const LayerOp& reader : ops) {
    if (!projects(reader.op)) continue;
    const LayerOp* producer = reader.input > 0 ? &ops[size_t(reader.input - 1)] : nullptr;
    if (producer == nullptr || !is_norm(producer->op)) {
      return "layer op '" + reader.name + "' reads a tensor no norm writes";
    }
    for (const LayerOp& other : ops) {
      if (!projects(other.op) && (other.input == reader.input || other.input2 == reader.input)) {
        return "norm '" + producer->name + "' is read by an op other than attention or an MLP";
      }
    }
  }
  return "";
}

// Which outputs a backward reads, and the last reader of each input.
void plan_storage(std::vector<LayerOp>& ops) {
  std::vector<bool> read_by_backward(ops.size() + 1, false);
  for (LayerOp& op : ops) {
    if (op.op == Op::add) continue;
    op.last_input_reader = !read_by_backward[size_t(op.input)];
    read_by_backward[size_t(op.input)] = true;
  }
  for (LayerOp& op : ops) op.keeps_output = read_by_backward[size_t(op.output)];
  for (const LayerOp& reader : ops) {
    if (reader.op == Op::attention || is_mlp(reader.op)) {
      if (reader.input > 0) ops[size_t(reader.input - 1)].gathered_output = true;
    }
  }
}

void check_wiring(const std::vector<LayerOp>& ops, const std::vector<std::string>& tensors,
                  const meshrun_kit_model_spec& spec) {
  std::vector<bool> read(tensors.size(), false);
  for (const LayerOp& op : ops) {
    read[size_t(op.input)] = true;
    if (op.input2 >= 0) read[size_t(op.input2)] = true;
  }
  require(tensors.back() == "out", OpChecker{spec.ops[spec.num_ops - 1], spec.num_ops - 1}.where() +
                                       " is the last op and writes '" + tensors.back() +
                                       "'; the last op writes the layer's output, 'out'");
  require(read[0], "kit: no layer op reads the layer's input 'x'");
  for (size_t t = 1; t + 1 < tensors.size(); ++t) {
    require(read[t], OpChecker{spec.ops[t - 1], int64_t(t - 1)}.where() + " writes '" + tensors[t] +
                         "', which no later op reads");
  }
}

std::string size_setting(const Composition& c, const char* size) {
  return "model." + c.size_name(size);
}

void check_positions(const Composition& c) {
  if (c.learned_positions()) {
    require(c.max_position_embeddings > 0,
            "kit: a learned position embedding needs max_position_embeddings, its rows");
    return;
  }
  require(c.max_position_embeddings >= 0,
          size_setting(c, "max_position_embeddings") + ": must not be negative");
  require(c.rope_theta > 0, "model.rope_theta: must be positive");
  require(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
          "model.partial_rotary_factor: must be in (0, 1]");
  require(c.attention_ops() == 0 || (c.rotary_dim() >= 2 && c.rotary_dim() % 2 == 0),
          "model.partial_rotary_factor: rotates " + std::to_string(c.rotary_dim()) +
              " channels of a head of " + std::to_string(c.head_dim()) +
              "; rotary embeddings rotate channel pairs, so it must be even and positive");
}

// The experts' sizes do something exactly when a MOE_MLP uses them.
void check_experts(const Composition& c) {
  const std::string experts = size_setting(c, "num_local_experts");
  const std::string per_token = size_setting(c, "num_experts_per_tok");
  if (c.moe_ops() == 0) {
    require(c.num_local_experts == 0 && c.num_experts_per_tok == 0 && c.router_aux_loss_coef == 0,
            "kit: num_local_experts, num_experts_per_tok and router_aux_loss_coef are for "
            "MESHRUN_KIT_MOE_MLP ops, and no layer op is one: leave them 0");
    return;
  }
  require(c.num_local_experts > 0,
          experts + ": must be positive, got " + std::to_string(c.num_local_experts));
  require(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_local_experts,
          per_token + ": " + std::to_string(c.num_experts_per_tok) +
              " experts per token; valid: 1 to " + experts + " (" +
              std::to_string(c.num_local_experts) + ")");
  require(c.router_aux_loss_coef >= 0, "model.router_aux_loss_coef: must not be negative");
}

void check_sizes(const Composition& c) {
  const auto positive = [&](int64_t value, const char* size) {
    require(value > 0, size_setting(c, size) + ": must be positive, got " + std::to_string(value));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  require(c.num_hidden_layers <= models::kMaxLayers,
          size_setting(c, "num_hidden_layers") + ": at most " + std::to_string(models::kMaxLayers));
  models::require_attention_heads(c.hidden_size, c.num_attention_heads, c.num_key_value_heads);
  require(c.norm_eps > 0, "kit: norm_eps must be positive");
  require(c.initializer_range > 0, "kit: initializer_range must be positive");
  check_positions(c);
  require(!(c.tie_word_embeddings && c.lm_head_bias),
          "kit: lm_head_bias with tie_word_embeddings: a tied lm_head has no bias of its own");
  check_experts(c);
}

// GPT-2's Conv1D layout names GELU MLPs and multi-head attention only.
void check_conv1d(const Composition& c, const meshrun_kit_model_spec& spec) {
  if (!c.conv1d) return;
  for (size_t i = 0; i < c.ops.size(); ++i) {
    const OpChecker check{spec.ops[i], int64_t(i)};
    check.require(c.ops[i].op != Op::swiglu_mlp && c.ops[i].op != Op::moe_mlp,
                  "is a " + std::string(op_name(c.ops[i].op)) +
                      ", which MESHRUN_KIT_CONV1D projections do not name (GELU_MLP: c_fc, "
                      "c_proj)");
    check.require(c.ops[i].op != Op::attention || c.num_key_value_heads == c.num_attention_heads,
                  "is an ATTENTION with grouped key/value heads, which a fused c_attn of "
                  "MESHRUN_KIT_CONV1D projections cannot shard: num_key_value_heads must be "
                  "num_attention_heads");
  }
}

// The module names: [A-Za-z0-9_.]+, as a parameter name's components.
std::string module_name(const char* value, const char* fallback, const char* field) {
  const std::string name = text(value, fallback);
  require(name.find_first_not_of("abcdefghijklmnopqrstuvwxyz"
                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.") == std::string::npos &&
              name.front() != '.' && name.back() != '.',
          std::string("kit: ") + field + " '" + name + "' is not a module name ([A-Za-z0-9_.]+)");
  return name;
}

const char* const kSizes[] = {
    "vocab_size",          "hidden_size",         "intermediate_size",       "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "num_local_experts",
    "num_experts_per_tok"};

ordered_json checked_size_keys(const char* json) {
  if (json == nullptr) return ordered_json::object();
  ordered_json keys = ordered_json::parse(json, nullptr, false);
  require(keys.is_object(), "kit: size_keys is not a JSON object");
  for (const auto& [size, key] : keys.items()) {
    require(std::find(std::begin(kSizes), std::end(kSizes), size) != std::end(kSizes),
            "kit: size_keys names '" + size +
                "'; valid: vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
                "num_attention_heads, num_key_value_heads, max_position_embeddings, "
                "num_local_experts, num_experts_per_tok");
    require(key.is_null() || (key.is_string() && !key.get<std::string>().empty()),
            "kit: size_keys." + size + " must be a config.json key or null");
  }
  return keys;
}

// An op's parameters, as add_op_parameters below makes them, with
// `experts` experts of a MOE_MLP.
int64_t parameter_count(const LayerOp& op, int64_t experts) {
  const int64_t in = op.bias_in ? 1 : 0, out = op.bias_out ? 1 : 0;
  switch (op.op) {
    case Op::rmsnorm:
      return 1;
    case Op::layernorm:
      return 2;
    case Op::attention:
      return 4 + 3 * in + out;
    case Op::swiglu_mlp:
      return 3 + 2 * in + out;
    case Op::gelu_mlp:
      return 2 + in + out;
    case Op::add:
      return 0;
    case Op::moe_mlp:
      return models::mixture_views(experts);
  }
  return 0;
}

int64_t conv1d_parameter_count(const LayerOp& op) {
  if (is_norm(op.op) || op.op == Op::add) return parameter_count(op, 0);
  return 2 + (op.bias_in ? 1 : 0) + (op.bias_out ? 1 : 0);
}

}  // namespace

std::string Composition::size_key(const std::string& size) const {
  if (!size_keys.contains(size)) return size;
  const ordered_json& key = size_keys.at(size);
  return key.is_null() ? "" : key.get<std::string>();
}

std::string Composition::size_name(const std::string& size) const {
  const std::string key = size_key(size);
  return key.empty() ? size : key;
}

int64_t Composition::attention_ops() const {
  return std::count_if(ops.begin(), ops.end(),
                       [](const LayerOp& op) { return op.op == Op::attention; });
}

int64_t Composition::moe_ops() const {
  return std::count_if(ops.begin(), ops.end(),
                       [](const LayerOp& op) { return op.op == Op::moe_mlp; });
}

std::vector<int64_t> Composition::first_views(int64_t local_experts) const {
  std::vector<int64_t> first;
  int64_t view = 0;
  for (const LayerOp& op : ops) {
    first.push_back(view);
    view += op.op == Op::moe_mlp ? models::mixture_views(local_experts) : op.views;
  }
  return first;
}

meshrun_kit_model_spec default_spec() {
  meshrun_kit_model_spec spec{};
  spec.struct_size = sizeof spec;
  spec.rope_theta = 10000.0;
  spec.partial_rotary_factor = 1.0;
  spec.initializer_range = 0.02;
  spec.final_norm = MESHRUN_KIT_RMSNORM;
  return spec;
}

Composition compose(const meshrun_kit_model_spec& spec, const std::string& model_type,
                    const ordered_json& user_config) {
  Composition c;
  c.model_type = model_type;
  c.architecture = text(spec.architecture, "");
  c.layer_class = text(spec.layer_class, "");
  c.vocab_size = spec.vocab_size;
  c.hidden_size = spec.hidden_size;
  c.intermediate_size = spec.intermediate_size;
  c.num_hidden_layers = spec.num_hidden_layers;
  c.num_attention_heads = spec.num_attention_heads;
  c.num_key_value_heads = spec.num_key_value_heads;
  c.max_position_embeddings = spec.max_position_embeddings;
  c.norm_eps = spec.norm_eps;
  c.rope_theta = spec.rope_theta;
  c.partial_rotary_factor = spec.partial_rotary_factor;
  c.initializer_range = spec.initializer_range;
  c.tie_word_embeddings = spec.tie_word_embeddings != 0;
  c.lm_head_bias = spec.lm_head_bias != 0;
  require(spec.final_norm == MESHRUN_KIT_RMSNORM || spec.final_norm == MESHRUN_KIT_LAYERNORM,
          "kit: final_norm must be MESHRUN_KIT_RMSNORM or MESHRUN_KIT_LAYERNORM");
  c.final_norm = Op(spec.final_norm);
  require(spec.projections == MESHRUN_KIT_LINEAR || spec.projections == MESHRUN_KIT_CONV1D,
          "kit: projections must be MESHRUN_KIT_LINEAR or MESHRUN_KIT_CONV1D");
  c.conv1d = spec.projections == MESHRUN_KIT_CONV1D;
  c.scale_output_init = spec.scale_output_init != 0;
  c.final_norm_name = module_name(spec.final_norm_name, "model.norm", "final_norm_name");
  c.attention_output_name = module_name(spec.attention_output_name, c.conv1d ? "c_proj" : "o_proj",
                                        "attention_output_name");
  c.embedding_name = module_name(spec.embedding_name, "model.embed_tokens", "embedding_name");
  c.layers_name = module_name(spec.layers_name, "model.layers", "layers_name");
  if (spec.position_embedding_name != nullptr) {
    c.position_embedding_name =
        module_name(spec.position_embedding_name, "", "position_embedding_name");
  }
  c.size_keys = checked_size_keys(spec.size_keys);
  c.num_local_experts = spec.num_local_experts;
  c.num_experts_per_tok = spec.num_experts_per_tok;
  c.router_aux_loss_coef = spec.router_aux_loss_coef;
  require(spec.num_ops > 0 && spec.ops != nullptr, "kit: the decoder layer has no ops");
  c.tensors = {"x"};
  for (int64_t i = 0; i < spec.num_ops; ++i) {
    c.ops.push_back(checked_op(spec.ops[i], i, c.tensors, c.ops));
  }
  check_wiring(c.ops, c.tensors, spec);
  plan_storage(c.ops);
  c.sequence_parallel_refusal = sequence_parallel_refusal(c.ops);
  int64_t view = 0;
  for (LayerOp& op : c.ops) {
    op.first_view = view;
    op.views = c.conv1d ? conv1d_parameter_count(op) : parameter_count(op, c.num_local_experts);
    view += op.views;
  }
  check_sizes(c);
  check_conv1d(c, spec);
  if (spec.config_json != nullptr) {
    c.config_extra = ordered_json::parse(spec.config_json, nullptr, false);
    require(c.config_extra.is_object(), "kit: config_json is not a JSON object");
  }
  for (const auto& [key, value] : user_config.items()) {
    if (key != "model_type" && key != "torch_dtype" && key != "checkpoint") {
      c.config_extra[key] = value;
    }
  }
  return c;
}

namespace {

// Appends parameter `name` of `unit`, computed over tp as `tp`.
void add(std::vector<ParameterView>& views, std::string name, std::vector<int64_t> shape,
         int64_t unit, const char* tp) {
  add_parameter(views, std::move(name), std::move(shape), unit);
  views.back().tp = tp;
}

// An op's projections as torch.nn.Linear: the input projections' weights
// [rows, H] (column-parallel), their biases, the output projection's
// weight [H, width] (row-parallel) and bias.
void add_linear_projections(std::vector<ParameterView>& views, const Composition& c,
                            const LayerOp& op, const std::string& p, int64_t layer) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  std::vector<std::pair<const char*, int64_t>> inputs;
  if (op.op == Op::attention) {
    inputs = {{"q_proj", c.q_dim()}, {"k_proj", c.kv_dim()}, {"v_proj", c.kv_dim()}};
  } else if (op.op == Op::swiglu_mlp) {
    inputs = {{"gate_proj", I}, {"up_proj", I}};
  } else {
    inputs = {{"fc1", I}};
  }
  const std::string output = op.op == Op::attention    ? c.attention_output_name
                             : op.op == Op::swiglu_mlp ? "down_proj"
                                                       : "fc2";
  const int64_t width = op.op == Op::attention ? c.q_dim() : I;
  for (const auto& [name, rows] : inputs)
    add(views, p + name + ".weight", {rows, H}, layer, "shard(0)");
  if (op.bias_in) {
    for (const auto& [name, rows] : inputs)
      add(views, p + name + ".bias", {rows}, layer, "shard(0)");
  }
  add(views, p + output + ".weight", {H, width}, layer, "shard(1)");
  if (op.bias_out) add(views, p + output + ".bias", {H}, layer, "replicate");
}

// An op's projections as GPT-2's Conv1D: each weight [in, out] followed by
// its bias; q/k/v fused as c_attn, each rank's columns of q, k and v.
void add_conv1d_projections(std::vector<ParameterView>& views, const Composition& c,
                            const LayerOp& op, const std::string& p, int64_t layer) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const bool attention = op.op == Op::attention;
  const std::string input = attention ? "c_attn" : "c_fc";
  const std::string output = attention ? c.attention_output_name : "c_proj";
  const int64_t width = attention ? c.q_dim() : I, columns = attention ? 3 * width : I;
  add(views, p + input + ".weight", {H, columns}, layer, attention ? "shard(1,3)" : "shard(1)");
  if (op.bias_in)
    add(views, p + input + ".bias", {columns}, layer, attention ? "shard(0,3)" : "shard(0)");
  add(views, p + output + ".weight", {width, H}, layer, "shard(0)");
  if (op.bias_out) add(views, p + output + ".bias", {H}, layer, "replicate");
}

// A MOE_MLP's router and experts, each expert's three with its number.
void add_experts(std::vector<ParameterView>& views, const Composition& c, const std::string& p,
                 int64_t layer) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  add(views, p + "gate.weight", {c.num_local_experts, H}, layer, "replicate");
  for (int64_t expert = 0; expert < c.num_local_experts; ++expert) {
    const std::string name = p + "experts." + std::to_string(expert) + ".";
    for (const auto& [projection, shape] :
         {std::pair<const char*, std::vector<int64_t>>{"w1", {I, H}},
          {"w3", {I, H}},
          {"w2", {H, I}}}) {
      add(views, name + projection + ".weight", shape, layer, "replicate");
      views.back().expert = expert;
    }
  }
}

// The parameters of op `op` of layer `layer`, appended.
void add_op_parameters(std::vector<ParameterView>& views, const Composition& c, const LayerOp& op,
                       int64_t layer) {
  const std::string p = c.layer_prefix() + std::to_string(layer) + "." + op.name + ".";
  const int64_t H = c.hidden_size;
  if (is_norm(op.op)) {
    add(views, p + "weight", {H}, layer, "replicate");
    if (op.op == Op::layernorm) add(views, p + "bias", {H}, layer, "replicate");
  } else if (op.op == Op::moe_mlp) {
    add_experts(views, c, p, layer);
  } else if (op.op != Op::add) {
    (c.conv1d ? add_conv1d_projections : add_linear_projections)(views, c, op, p, layer);
  }
}

bool is_bias(const std::string& parameter) {
  return parameter.size() > 5 && parameter.compare(parameter.size() - 5, 5, ".bias") == 0;
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

// The op of layer parameter `parameter` and the rest of its name past the
// op's ("o_proj.weight"), or null for a parameter outside the layers.
std::pair<const LayerOp*, std::string> layer_op_of(const Composition& c,
                                                   const std::string& parameter) {
  const std::string prefix = c.layer_prefix();
  if (!starts_with(parameter, prefix)) return {nullptr, ""};
  const size_t op_start = parameter.find('.', prefix.size());
  if (op_start == std::string::npos) return {nullptr, ""};
  const std::string in_layer = parameter.substr(op_start + 1);
  for (const LayerOp& op : c.ops) {
    if (!op.name.empty() && starts_with(in_layer, op.name + ".")) {
      return {&op, in_layer.substr(op.name.size() + 1)};
    }
  }
  return {nullptr, ""};
}

// An output projection's weight: what scale_output_init scales.
bool is_output_projection_weight(const Composition& c, const std::string& parameter) {
  const auto [op, rest] = layer_op_of(c, parameter);
  if (op == nullptr || is_bias(rest)) return false;
  if (op->op == Op::attention) return rest == c.attention_output_name + ".weight";
  if (op->op == Op::moe_mlp) return rest.size() > 10 && rest.ends_with(".w2.weight");
  const char* output = c.conv1d ? "c_proj" : op->op == Op::swiglu_mlp ? "down_proj" : "fc2";
  return is_mlp(op->op) && rest == std::string(output) + ".weight";
}

}  // namespace

std::vector<ParameterView> parameters(const Composition& c) {
  const int64_t H = c.hidden_size;
  const DecoderUnits units(c.num_hidden_layers);
  std::vector<ParameterView> views;
  add(views, c.embedding_weight(), {c.vocab_size, H}, units.token_embedding(c.tie_word_embeddings),
      "shard(0)");
  if (c.learned_positions()) {
    add(views, c.position_weight(), {c.max_position_embeddings, H}, units.embedding, "replicate");
  }
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    for (const LayerOp& op : c.ops) add_op_parameters(views, c, op, layer);
  }
  add(views, c.final_norm_name + ".weight", {H}, units.head, "replicate");
  if (c.final_norm == Op::layernorm) {
    add(views, c.final_norm_name + ".bias", {H}, units.head, "replicate");
  }
  if (c.lm_head_bias) add(views, "lm_head.bias", {c.vocab_size}, units.head, "shard(0)");
  if (!c.tie_word_embeddings) {
    add(views, "lm_head.weight", {c.vocab_size, H}, units.head, "shard(0)");
  }
  const std::string vocab = c.size_name("vocab_size"), hidden = c.size_name("hidden_size");
  const std::string intermediate = c.size_name("intermediate_size");
  const std::string positions = c.size_name("max_position_embeddings");
  const std::string experts = c.size_name("num_local_experts");
  models::require_addressable(views, {{vocab.c_str(), c.vocab_size},
                                      {hidden.c_str(), H},
                                      {intermediate.c_str(), c.intermediate_size},
                                      {positions.c_str(), c.max_position_embeddings},
                                      {experts.c_str(), c.num_local_experts}});
  return views;
}

void init_parameter(const Composition& c, const std::vector<ParameterView>& parameters,
                    uint64_t seed, int64_t index, float* values) {
  const ParameterView& view = parameters.at(size_t(index));
  if (view.shape.size() > 1) {
    // GPT-2's scaling of the projections into the residual stream, which
    // num_hidden_layers layers' worth add up.
    const bool scaled = c.scale_output_init && is_output_projection_weight(c, view.name);
    const double scale = scaled ? 1.0 / std::sqrt(2.0 * double(c.num_hidden_layers)) : 1.0;
    return models::init_normal(parameters, seed, index, c.initializer_range * scale, values);
  }
  std::fill_n(values, view.numel, is_bias(view.name) ? 0.0f : 1.0f);
}

std::optional<Block> tensor_parallel_block(const Composition& c, const std::string& parameter) {
  if (parameter == c.embedding_weight()) return Block::embedding;
  if (starts_with(parameter, "lm_head.")) return Block::head;
  const LayerOp* op = layer_op_of(c, parameter).first;
  if (op == nullptr || !(op->op == Op::attention || is_mlp(op->op))) return std::nullopt;
  return op->op == Op::attention ? Block::attention : Block::mlp;
}

std::vector<models::BlockSpec> tensor_parallel_blocks(const Composition& c) {
  models::BlockSpec embedding{Block::embedding, {{c.embedding_name, "rowwise"}}};
  models::BlockSpec attention{Block::attention, {}}, mlp{Block::mlp, {}};
  for (const LayerOp& op : c.ops) {
    const std::string p = c.layer_prefix() + "*." + op.name + ".";
    std::vector<std::string> columns;
    std::string rows;
    if (op.op == Op::attention) {
      columns = c.conv1d ? std::vector<std::string>{"c_attn"}
                         : std::vector<std::string>{"q_proj", "k_proj", "v_proj"};
      rows = c.attention_output_name;
    } else if (op.op == Op::swiglu_mlp) {
      columns = {"gate_proj", "up_proj"};
      rows = "down_proj";
    } else if (op.op == Op::gelu_mlp) {
      columns = {c.conv1d ? "c_fc" : "fc1"};
      rows = c.conv1d ? "c_proj" : "fc2";
    } else {
      continue;
    }
    models::BlockSpec& block = op.op == Op::attention ? attention : mlp;
    for (const std::string& name : columns) block.modules.push_back({p + name, "colwise"});
    block.modules.push_back({p + rows, "rowwise"});
  }
  std::vector<models::BlockSpec> specs{embedding};
  if (!attention.modules.empty()) specs.push_back(attention);
  if (!mlp.modules.empty()) specs.push_back(mlp);
  if (!c.tie_word_embeddings) specs.push_back({Block::head, {{"lm_head", "colwise"}}});
  return specs;
}

void check_tensor_parallel(const Composition& c, int64_t tp, const models::ParallelBlocks& blocks) {
  for (const LayerOp& op : c.ops) {
    require(tp == 1 || op.op != Op::moe_mlp,
            "kit: tensor parallelism: layer op '" + op.name +
                "' is a MOE_MLP, which computes its experts whole on each rank "
                "(distributed.tp_size must be 1; spread the experts with ep_size)");
  }
  const std::string heads = c.size_name("num_attention_heads");
  const std::string kv_heads = c.size_name("num_key_value_heads");
  const std::string intermediate = c.size_name("intermediate_size");
  const std::string vocab = c.size_name("vocab_size");
  models::require_divisible(
      {{heads.c_str(), c.num_attention_heads, blocks[Block::attention]},
       {kv_heads.c_str(), c.num_key_value_heads, blocks[Block::attention]},
       {intermediate.c_str(), c.intermediate_size, blocks[Block::mlp]},
       {vocab.c_str(), c.vocab_size, blocks[Block::embedding] || blocks[Block::head]}},
      tp);
}

// The token and position embeddings stay together: the first stage adds them.
models::ModelModules modules(const Composition& c) {
  const std::string embedding = c.embedding_weight();
  std::vector<std::string> norm{c.final_norm_name + ".weight"};
  if (c.final_norm == Op::layernorm) norm.push_back(c.final_norm_name + ".bias");
  std::vector<std::string> lm_head{c.tie_word_embeddings ? embedding : "lm_head.weight"};
  if (c.lm_head_bias) lm_head.push_back("lm_head.bias");
  std::vector<models::ModuleSpec> embeddings{{c.embedding_name, {embedding}, ""}};
  if (c.learned_positions()) {
    embeddings.front().group = "embeddings";
    embeddings.push_back({c.position_embedding_name, {c.position_weight()}, "embeddings"});
  }
  return {embeddings,
          c.layer_prefix(),
          {{c.final_norm_name, norm, "head"}, {"lm_head", lm_head, "head"}}};
}

namespace {

// The sizes under their config.json keys; then the plugin's keys and the
// user's; then the sizes again, so that a key the user left to the model
// (n_inner = null) says what was made.
ordered_json hf_config(const Composition& c) {
  ordered_json config = {{"architectures", {c.architecture}}, {"model_type", c.model_type}};
  const auto write_sizes = [&] {
    const std::pair<const char*, int64_t> sizes[] = {
        {"vocab_size", c.vocab_size},
        {"max_position_embeddings", c.max_position_embeddings},
        {"hidden_size", c.hidden_size},
        {"intermediate_size", c.intermediate_size},
        {"num_hidden_layers", c.num_hidden_layers},
        {"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.num_key_value_heads},
        {"num_local_experts", c.num_local_experts},
        {"num_experts_per_tok", c.num_experts_per_tok}};
    for (const auto& [size, value] : sizes) {
      const std::string key = c.size_key(size);
      if (!key.empty() && value > 0) config[key] = value;
    }
    config["tie_word_embeddings"] = c.tie_word_embeddings;
    if (c.moe_ops() > 0) config["router_aux_loss_coef"] = c.router_aux_loss_coef;
  };
  write_sizes();
  for (const auto& [key, value] : c.config_extra.items()) config[key] = value;
  write_sizes();
  return config;
}

// The GEMMs a forward runs, as composed.cpp and mixture_of_experts.cpp run
// them: attention's fused q/k/v projection (column-parallel) and its output
// (row-parallel), an MLP's fused input projection and its output, a
// mixture's router and each expert's two (on top_k / experts of the rows),
// and lm_head (vocabulary-parallel).
std::vector<models::GemmShape> gemm_shapes(const Composition& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, L = c.num_hidden_layers;
  const int64_t E = c.num_local_experts;
  std::vector<models::GemmShape> gemms;
  for (const LayerOp& op : c.ops) {
    if (op.op == Op::attention) {
      gemms.push_back({H, c.q_dim() + 2 * c.kv_dim(), L, 1.0, "n"});
      gemms.push_back({c.q_dim(), H, L, 1.0, "k"});
    }
    if (op.op == Op::swiglu_mlp || op.op == Op::gelu_mlp) {
      gemms.push_back({H, (op.op == Op::swiglu_mlp ? 2 : 1) * I, L, 1.0, "n"});
      gemms.push_back({I, H, L, 1.0, "k"});
    }
    if (op.op == Op::moe_mlp) {
      const double rows = double(c.num_experts_per_tok) / double(E);
      gemms.push_back({H, E, L, 1.0, ""});
      gemms.push_back({H, 2 * I, E * L, rows, ""});
      gemms.push_back({I, H, E * L, rows, ""});
    }
  }
  gemms.push_back({H, c.vocab_size, 1, 1.0, "n"});
  return gemms;
}

// Weights a token meets in matmuls: those of the GEMMs, each on its share
// of the rows.
int64_t matmul_parameters(const std::vector<models::GemmShape>& gemms) {
  double weights = 0;
  for (const models::GemmShape& g : gemms) {
    weights += double(g.k) * double(g.n) * double(g.count) * g.rows;
  }
  return std::llround(weights);
}

// What composed.hpp's activations hold per token, in elements, and of
// those what Composed::low_precision leaves in float32.
std::pair<models::ActivationsPerToken, models::Float32PerToken> activations(const Composition& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t final_stats = c.final_norm == Op::layernorm ? 2 : 1;
  models::ActivationsPerToken a{0, 0, 0, 0, H, H + final_stats, c.vocab_size};
  models::Float32PerToken f{0, 0, 0, 0, final_stats, c.vocab_size};
  for (const LayerOp& op : c.ops) {
    const int64_t stats = op.op == Op::layernorm ? 2 : 1;
    if (is_norm(op.op)) {
      a.layer_whole += stats + (op.keeps_output ? H : 0);
      a.elementwise_whole += stats + (op.keeps_output ? H : 0);
      f.layer_whole += stats;
      f.elementwise_whole += stats;
    } else if (op.op == Op::attention) {
      a.layer_split += c.q_dim() + 2 * c.kv_dim() + c.num_attention_heads + c.q_dim();
      f.layer_split += c.num_attention_heads;
    } else if (is_mlp(op.op)) {
      a.layer_split += (op.op == Op::swiglu_mlp ? 2 * I : I) + I;
      a.elementwise_split += I;
    } else if (op.op == Op::moe_mlp) {
      // The router's softmax, each slot's expert, weight and place (the
      // int64 as two), the experts' outputs, inputs, w1/w3 outputs and
      // activations: top_k slots per token, whatever rank computes them.
      const int64_t K = c.num_experts_per_tok;
      a.layer_whole += c.num_local_experts + 4 * K + K * (2 * H + 3 * I);
      f.layer_whole += c.num_local_experts + 4 * K;
    }
    if (!is_norm(op.op) && op.keeps_output) a.layer_whole += H;
  }
  return {a, f};
}

}  // namespace

std::string describe(const Composition& c, const std::vector<ParameterView>& parameters,
                     bool on_cuda) {
  ordered_json fields = {{"config", hf_config(c)},
                         {"vocab_size", c.vocab_size},
                         {"max_seq_len", nullptr},
                         {"num_layers_key", c.size_name("num_hidden_layers")},
                         {"sequence_parallel", c.sequence_parallel_refusal.empty()},
                         {"autocast_dtypes", {"bfloat16"}}};
  fields["devices"] = on_cuda ? ordered_json{"cpu", "cuda"} : ordered_json{"cpu"};
  if (c.max_position_embeddings > 0) fields["max_seq_len"] = c.max_position_embeddings;
  if (!c.layer_class.empty()) fields["unit_class"] = c.layer_class;
  if (c.moe_ops() > 0) {
    fields["experts"] = {{"count", c.num_local_experts}, {"top_k", c.num_experts_per_tok}};
    fields["tensor_parallel"] = false;
  }
  // A mixture's load-balancing loss is over the rank's tokens, which
  // context parallelism would cut: only models without one compute it.
  if (c.attention_ops() > 0 && c.moe_ops() == 0) {
    fields["context_parallel"] = {{"heads", c.num_attention_heads},
                                  {"kv_heads", c.num_key_value_heads}};
  }
  fields["tp_blocks"] = models::tp_blocks_json(tensor_parallel_blocks(c));
  const std::vector<models::GemmShape> gemms = gemm_shapes(c);
  fields["flops"] = models::flops_json(matmul_parameters(gemms),
                                       c.num_hidden_layers * c.attention_ops(), c.q_dim(), gemms);
  const auto [kept, float32] = activations(c);
  fields["activations"] = models::activations_json(kept, float32);
  return models::describe_model(std::move(fields), parameters, c.num_hidden_layers, modules(c));
}

}  // namespace meshrun::kit
