#include "kit/composition.hpp"

#include <algorithm>
#include <stdexcept>

namespace meshrun::kit {

using models::add_parameter;
using models::Block;
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
      spec.op >= MESHRUN_KIT_RMSNORM && spec.op <= MESHRUN_KIT_ADD,
      "has op " + std::to_string(spec.op) +
          "; valid: MESHRUN_KIT_RMSNORM, LAYERNORM, ATTENTION, SWIGLU_MLP, GELU_MLP, ADD");
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
  check.require(spec.flags == 0 || (projects && (spec.flags & ~3) == 0),
                "has flags " + std::to_string(spec.flags) +
                    "; only ATTENTION and the MLPs take MESHRUN_KIT_BIAS_IN | BIAS_OUT");
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

void check_sizes(const Composition& c) {
  const auto positive = [](int64_t value, const char* key) {
    require(value > 0,
            std::string("model.") + key + ": must be positive, got " + std::to_string(value));
  };
  positive(c.vocab_size, "vocab_size");
  positive(c.hidden_size, "hidden_size");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  require(c.num_hidden_layers <= models::kMaxLayers,
          "model.num_hidden_layers: at most " + std::to_string(models::kMaxLayers));
  models::require_attention_heads(c.hidden_size, c.num_attention_heads, c.num_key_value_heads);
  require(c.norm_eps > 0, "kit: norm_eps must be positive");
  require(c.rope_theta > 0, "model.rope_theta: must be positive");
  require(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1,
          "model.partial_rotary_factor: must be in (0, 1]");
  require(c.attention_ops() == 0 || (c.rotary_dim() >= 2 && c.rotary_dim() % 2 == 0),
          "model.partial_rotary_factor: rotates " + std::to_string(c.rotary_dim()) +
              " channels of a head of " + std::to_string(c.head_dim()) +
              "; rotary embeddings rotate channel pairs, so it must be even and positive");
  require(!(c.tie_word_embeddings && c.lm_head_bias),
          "kit: lm_head_bias with tie_word_embeddings: a tied lm_head has no bias of its own");
}

// An op's parameters, as add_op_parameters below makes them.
int64_t parameter_count(const LayerOp& op) {
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
  }
  return 0;
}

}  // namespace

int64_t Composition::attention_ops() const {
  return std::count_if(ops.begin(), ops.end(),
                       [](const LayerOp& op) { return op.op == Op::attention; });
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
  c.norm_eps = spec.norm_eps;
  c.rope_theta = spec.rope_theta;
  c.partial_rotary_factor = spec.partial_rotary_factor;
  c.tie_word_embeddings = spec.tie_word_embeddings != 0;
  c.lm_head_bias = spec.lm_head_bias != 0;
  require(spec.final_norm == MESHRUN_KIT_RMSNORM || spec.final_norm == MESHRUN_KIT_LAYERNORM,
          "kit: final_norm must be MESHRUN_KIT_RMSNORM or MESHRUN_KIT_LAYERNORM");
  c.final_norm = Op(spec.final_norm);
  c.final_norm_name = text(spec.final_norm_name, "model.norm");
  c.attention_output_name = text(spec.attention_output_name, "o_proj");
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
    op.views = parameter_count(op);
    view += op.views;
  }
  check_sizes(c);
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

// The parameters of op `op` of layer `layer`, appended.
void add_op_parameters(std::vector<ParameterView>& views, const Composition& c, const LayerOp& op,
                       int64_t layer) {
  const std::string p = "model.layers." + std::to_string(layer) + "." + op.name + ".";
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const auto linears = [&](std::initializer_list<std::pair<const char*, int64_t>> inputs,
                           const std::string& output, int64_t output_in) {
    for (const auto& [name, rows] : inputs)
      add_parameter(views, p + name + ".weight", {rows, H}, layer);
    if (op.bias_in) {
      for (const auto& [name, rows] : inputs)
        add_parameter(views, p + name + ".bias", {rows}, layer);
    }
    add_parameter(views, p + output + ".weight", {H, output_in}, layer);
    if (op.bias_out) add_parameter(views, p + output + ".bias", {H}, layer);
  };
  switch (op.op) {
    case Op::rmsnorm:
      add_parameter(views, p + "weight", {H}, layer);
      break;
    case Op::layernorm:
      add_parameter(views, p + "weight", {H}, layer);
      add_parameter(views, p + "bias", {H}, layer);
      break;
    case Op::attention:
      linears({{"q_proj", c.q_dim()}, {"k_proj", c.kv_dim()}, {"v_proj", c.kv_dim()}},
              c.attention_output_name, c.q_dim());
      break;
    case Op::swiglu_mlp:
      linears({{"gate_proj", I}, {"up_proj", I}}, "down_proj", I);
      break;
    case Op::gelu_mlp:
      linears({{"fc1", I}}, "fc2", I);
      break;
    case Op::add:
      break;
  }
}

// The projection a parameter belongs to: its name's next-to-last component.
std::string projection_of(const std::string& parameter) {
  const size_t last = parameter.rfind('.');
  if (last == std::string::npos) return "";
  const size_t before = parameter.rfind('.', last - 1);
  return parameter.substr(before == std::string::npos ? 0 : before + 1,
                          last - (before == std::string::npos ? 0 : before + 1));
}

bool is_bias(const std::string& parameter) {
  return parameter.size() > 5 && parameter.compare(parameter.size() - 5, 5, ".bias") == 0;
}

const std::vector<std::string> kColumnParallel = {"q_proj",    "k_proj",  "v_proj",
                                                  "gate_proj", "up_proj", "fc1"};
const std::vector<std::string> kRowParallel = {"down_proj", "fc2"};

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// How the kit computes a parameter over tp (meshrun/model.h "tp").
std::string placement(const Composition& c, const std::string& parameter) {
  if (parameter == "model.embed_tokens.weight" || parameter.rfind("lm_head.", 0) == 0) {
    return "shard(0)";
  }
  if (parameter.rfind("model.layers.", 0) != 0) return "replicate";
  const std::string projection = projection_of(parameter);
  if (contains(kColumnParallel, projection)) return "shard(0)";
  const bool row = contains(kRowParallel, projection) || projection == c.attention_output_name;
  return row && !is_bias(parameter) ? "shard(1)" : "replicate";
}

}  // namespace

std::vector<ParameterView> parameters(const Composition& c) {
  const int64_t H = c.hidden_size, root = c.num_hidden_layers;
  std::vector<ParameterView> views;
  add_parameter(views, "model.embed_tokens.weight", {c.vocab_size, H}, root);
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    for (const LayerOp& op : c.ops) add_op_parameters(views, c, op, layer);
  }
  add_parameter(views, c.final_norm_name + ".weight", {H}, root);
  if (c.final_norm == Op::layernorm) add_parameter(views, c.final_norm_name + ".bias", {H}, root);
  if (c.lm_head_bias) add_parameter(views, "lm_head.bias", {c.vocab_size}, root);
  if (!c.tie_word_embeddings) add_parameter(views, "lm_head.weight", {c.vocab_size, H}, root);
  for (ParameterView& view : views) view.tp = placement(c, view.name);
  models::require_addressable(views, {{"vocab_size", c.vocab_size},
                                      {"hidden_size", H},
                                      {"intermediate_size", c.intermediate_size}});
  return views;
}

void init_parameter(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                    float* values) {
  const ParameterView& view = parameters.at(size_t(index));
  if (view.shape.size() > 1) return models::init_normal(parameters, seed, index, 0.02, values);
  const bool norm_weight = !is_bias(view.name) && view.name.find("_proj.") == std::string::npos &&
                           view.name.find(".fc") == std::string::npos;
  std::fill_n(values, view.numel, norm_weight ? 1.0f : 0.0f);
}

std::optional<Block> tensor_parallel_block(const std::string& parameter) {
  if (parameter == "model.embed_tokens.weight") return Block::embedding;
  if (parameter.rfind("lm_head.", 0) == 0) return Block::head;
  if (parameter.rfind("model.layers.", 0) != 0) return std::nullopt;
  const std::string projection = projection_of(parameter);
  if (contains({"gate_proj", "up_proj", "down_proj", "fc1", "fc2"}, projection)) return Block::mlp;
  // The attention's output projection has an author's name: every other
  // layer parameter a plan places is attention's.
  return Block::attention;
}

std::vector<models::BlockSpec> tensor_parallel_blocks(const Composition& c) {
  models::BlockSpec embedding{Block::embedding, {{"model.embed_tokens", "rowwise"}}};
  models::BlockSpec attention{Block::attention, {}}, mlp{Block::mlp, {}};
  for (const LayerOp& op : c.ops) {
    const std::string p = "model.layers.*." + op.name + ".";
    if (op.op == Op::attention) {
      for (const char* name : {"q_proj", "k_proj", "v_proj"})
        attention.modules.push_back({p + name, "colwise"});
      attention.modules.push_back({p + c.attention_output_name, "rowwise"});
    } else if (op.op == Op::swiglu_mlp) {
      mlp.modules.push_back({p + "gate_proj", "colwise"});
      mlp.modules.push_back({p + "up_proj", "colwise"});
      mlp.modules.push_back({p + "down_proj", "rowwise"});
    } else if (op.op == Op::gelu_mlp) {
      mlp.modules.push_back({p + "fc1", "colwise"});
      mlp.modules.push_back({p + "fc2", "rowwise"});
    }
  }
  std::vector<models::BlockSpec> specs{embedding};
  if (!attention.modules.empty()) specs.push_back(attention);
  if (!mlp.modules.empty()) specs.push_back(mlp);
  if (!c.tie_word_embeddings) specs.push_back({Block::head, {{"lm_head", "colwise"}}});
  return specs;
}

void check_tensor_parallel(const Composition& c, int64_t tp, const models::ParallelBlocks& blocks) {
  models::require_divisible(
      {{"num_attention_heads", c.num_attention_heads, blocks[Block::attention]},
       {"num_key_value_heads", c.num_key_value_heads, blocks[Block::attention]},
       {"intermediate_size", c.intermediate_size, blocks[Block::mlp]},
       {"vocab_size", c.vocab_size, blocks[Block::embedding] || blocks[Block::head]}},
      tp);
}

models::ModelModules modules(const Composition& c) {
  const std::string embedding = "model.embed_tokens.weight";
  std::vector<std::string> norm{c.final_norm_name + ".weight"};
  if (c.final_norm == Op::layernorm) norm.push_back(c.final_norm_name + ".bias");
  std::vector<std::string> lm_head{c.tie_word_embeddings ? embedding : "lm_head.weight"};
  if (c.lm_head_bias) lm_head.push_back("lm_head.bias");
  return {{{"model.embed_tokens", {embedding}, ""}},
          "model.layers.",
          {{c.final_norm_name, norm, "head"}, {"lm_head", lm_head, "head"}}};
}

namespace {

ordered_json hf_config(const Composition& c) {
  ordered_json config = {{"architectures", {c.architecture}},
                         {"model_type", c.model_type},
                         {"vocab_size", c.vocab_size},
                         {"hidden_size", c.hidden_size},
                         {"intermediate_size", c.intermediate_size},
                         {"num_hidden_layers", c.num_hidden_layers},
                         {"num_attention_heads", c.num_attention_heads},
                         {"num_key_value_heads", c.num_key_value_heads},
                         {"tie_word_embeddings", c.tie_word_embeddings}};
  for (const auto& [key, value] : c.config_extra.items()) config[key] = value;
  return config;
}

// Weights a token meets in matmuls, per layer and in lm_head.
int64_t matmul_parameters(const Composition& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  int64_t layer = 0;
  for (const LayerOp& op : c.ops) {
    if (op.op == Op::attention) layer += H * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * H;
    if (op.op == Op::swiglu_mlp) layer += 3 * H * I;
    if (op.op == Op::gelu_mlp) layer += 2 * H * I;
  }
  return c.num_hidden_layers * layer + c.vocab_size * H;
}

// What composed.hpp's activations hold per token, in float32 elements.
models::ActivationsPerToken activations(const Composition& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  models::ActivationsPerToken a{
      0, 0, 0, 0, H, H + (c.final_norm == Op::layernorm ? 2 : 1), c.vocab_size};
  for (const LayerOp& op : c.ops) {
    const int64_t stats = op.op == Op::layernorm ? 2 : 1;
    if (is_norm(op.op)) {
      a.layer_whole += stats + (op.keeps_output ? H : 0);
      a.elementwise_whole += stats + (op.keeps_output ? H : 0);
    } else if (op.op == Op::attention) {
      a.layer_split += c.q_dim() + 2 * c.kv_dim() + c.num_attention_heads + c.q_dim();
    } else if (is_mlp(op.op)) {
      a.layer_split += (op.op == Op::swiglu_mlp ? 2 * I : I) + I;
      a.elementwise_split += I;
    }
    if (!is_norm(op.op) && op.keeps_output) a.layer_whole += H;
  }
  return a;
}

}  // namespace

std::string describe(const Composition& c, const std::vector<ParameterView>& parameters) {
  ordered_json fields = {{"config", hf_config(c)},
                         {"vocab_size", c.vocab_size},
                         {"max_seq_len", nullptr},
                         {"num_layers_key", "num_hidden_layers"},
                         {"sequence_parallel", c.sequence_parallel_refusal.empty()},
                         {"autocast_dtypes", {"bfloat16"}}};
  if (!c.layer_class.empty()) fields["unit_class"] = c.layer_class;
  if (c.attention_ops() > 0) {
    fields["context_parallel"] = {{"heads", c.num_attention_heads},
                                  {"kv_heads", c.num_key_value_heads}};
  }
  fields["tp_blocks"] = models::tp_blocks_json(tensor_parallel_blocks(c));
  fields["flops"] =
      models::flops_json(matmul_parameters(c), c.num_hidden_layers * c.attention_ops(), c.q_dim());
  fields["activations"] = models::activations_json(activations(c));
  return models::describe_model(std::move(fields), parameters, c.num_hidden_layers, modules(c));
}

}  // namespace meshrun::kit
