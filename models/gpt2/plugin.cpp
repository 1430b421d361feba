// The GPT-2 model plugin (meshrun/model.h, model_type "gpt2"): the
// configuration from [model] with Hugging Face GPT2Config's keys, the
// description (parameters, units, modules, the Hugging Face config.json) and
// stages of the model over the host's hooks (common/host_stage.hpp). No
// sidecar: the default plan covers units and the pipeline split.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/host_stage.hpp"
#include "gpt2/model.hpp"
#include "gpt2/stage.hpp"

namespace {

using meshrun::gpt2::Gpt2Config;
using meshrun::gpt2::ParameterView;
using meshrun::models::ModelModules;
using nlohmann::ordered_json;

// The dropout keys are taken at 0 only, so that a Hugging Face config.json
// reads as it is and the exported one says what was trained.
const char* const kConfigKeys[] = {"vocab_size",
                                   "n_positions",
                                   "n_embd",
                                   "n_layer",
                                   "n_head",
                                   "n_inner",
                                   "activation_function",
                                   "layer_norm_epsilon",
                                   "initializer_range",
                                   "tie_word_embeddings",
                                   "resid_pdrop",
                                   "embd_pdrop",
                                   "attn_pdrop",
                                   nullptr};

struct Gpt2Plugin {
  using Family = meshrun::gpt2::Gpt2;

  static Gpt2Config read_config(const char* config_json) {
    const meshrun::models::ConfigReader reader(config_json);
    Gpt2Config c;
    c.vocab_size = reader.dimension("vocab_size", c.vocab_size);
    c.n_positions = reader.dimension("n_positions", c.n_positions);
    c.n_embd = reader.dimension("n_embd", c.n_embd);
    c.n_layer = reader.integer("n_layer", c.n_layer, 1, meshrun::models::kMaxLayers);
    c.n_head = reader.integer("n_head", c.n_head);
    c.n_inner = reader.nullable_integer("n_inner", 4 * c.n_embd);
    reader.choice("activation_function", "gelu_new", {"gelu_new"});
    c.layer_norm_epsilon = reader.positive_number("layer_norm_epsilon", c.layer_norm_epsilon);
    c.initializer_range = reader.positive_number("initializer_range", c.initializer_range);
    c.tie_word_embeddings = reader.boolean("tie_word_embeddings", c.tie_word_embeddings);
    for (const char* dropout : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) {
      reader.require_number(dropout, 0.0, "training here has no dropout");
    }
    meshrun::gpt2::check_config(c);
    return c;
  }

  // Every key GPT2Config reads for the compute of GPT2LMHeadModel, resolved;
  // n_ctx as Hugging Face's GPT-2 checkpoints write it.
  static ordered_json hf_config(const Gpt2Config& c) {
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", c.vocab_size},
            {"n_positions", c.n_positions},
            {"n_ctx", c.n_positions},
            {"n_embd", c.n_embd},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_inner", c.n_inner},
            {"activation_function", "gelu_new"},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"layer_norm_epsilon", c.layer_norm_epsilon},
            {"initializer_range", c.initializer_range},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"tie_word_embeddings", c.tie_word_embeddings}};
  }

  // The embeddings (wte and wpe, which the first stage adds), the blocks,
  // and the head (ln_f and lm_head, inseparable: the loss needs both); a
  // tied lm_head uses wte.
  static ModelModules modules(const Gpt2Config& config) {
    const std::string wte = "transformer.wte.weight";
    return {{{"transformer.wte", {wte}, "embeddings"},
             {"transformer.wpe", {"transformer.wpe.weight"}, "embeddings"}},
            "transformer.h.",
            {{"transformer.ln_f", {"transformer.ln_f.weight", "transformer.ln_f.bias"}, "head"},
             {"lm_head", {config.tie_word_embeddings ? wte : "lm_head.weight"}, "head"}}};
  }

  // Weights a token meets in matmuls: per layer c_attn (q, k, v), the
  // attention's c_proj and the MLP's c_fc and c_proj; then the lm_head.
  static int64_t matmul_parameters(const Gpt2Config& c) {
    const int64_t layer = 4 * c.n_embd * c.n_embd + 2 * c.n_embd * c.n_inner;
    return c.n_layer * layer + c.vocab_size * c.n_embd;
  }

  // What stage.hpp's BlockActivations and HeadActivations hold per token:
  // ln1, mean1, rstd1, h, ln2, mean2, rstd2 whole; qkv, the heads'
  // log-sum-exps, the attention output, fc and act split over tp; selective
  // checkpointing drops the norms and act (Gpt2::elementwise).
  static meshrun::models::ActivationsPerToken activations(const Gpt2Config& c) {
    const int64_t e = c.n_embd;
    return {3 * e + 4,   3 * e + c.n_head + e + 2 * c.n_inner, 2 * e + 4, c.n_inner, e, e + 2,
            c.vocab_size};
  }

  static std::string describe(const Gpt2Config& config,
                              const std::vector<ParameterView>& parameters) {
    return meshrun::models::describe_model(
        {{"config", hf_config(config)},
         {"vocab_size", config.vocab_size},
         {"max_seq_len", config.n_positions},
         {"num_layers_key", "n_layer"},
         {"sequence_parallel", Family::kSequenceParallel},
         {"autocast_dtypes", {"bfloat16"}},
         {"unit_class", "GPT2Block"},
         {"context_parallel", {{"heads", config.n_head}, {"kv_heads", config.n_head}}},
         {"tp_blocks", meshrun::models::tp_blocks_json(tensor_parallel_blocks(config))},
         {"flops",
          meshrun::models::flops_json(matmul_parameters(config), config.n_layer, config.n_embd)},
         {"activations", meshrun::models::activations_json(activations(config))}},
        parameters, config.n_layer, modules(config));
  }
};

const meshrun_model_api kModelApi =
    meshrun::plugin::ModelTable<meshrun::models::HostModel<Gpt2Plugin>,
                                meshrun::models::HostStage<Gpt2Plugin>>::make("gpt2", kConfigKeys);

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "gpt2", MESHRUN_PLUGIN_VERSION,
    "GPT-2 (GPT2LMHeadModel): learned positions, pre-LayerNorm blocks with biases, multi-head "
    "attention, gelu_new; GEMMs through oneDNN in float32 or bfloat16; pipeline stages with split "
    "backward",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
