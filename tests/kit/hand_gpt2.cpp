// The hand-written GPT-2 (model_type "hand_gpt2"): the GPT-2 family of
// gpt2/stage.hpp as a model plugin, the oracle of the shipped gpt2 plugin,
// which the model kit composes (tests/kit/test_kit_models.py: equal bit for
// bit). The configuration from [model] with Hugging Face GPT2Config's keys,
// the description and stages of the model over the host's hooks
// (common/host_stage.hpp).
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

struct Gpt2Plugin {
  using Family = meshrun::gpt2::Gpt2;

  static Gpt2Config read_config(const char* config_json) {
    return meshrun::gpt2::read_config(meshrun::models::ConfigReader(config_json));
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
  // checkpointing drops the norms and act (Gpt2::elementwise). A bfloat16
  // run keeps the means and 1/std, log-sum-exps and logits in float32
  // (Gpt2::low_precision).
  static ordered_json activations(const Gpt2Config& c) {
    const int64_t e = c.n_embd;
    return meshrun::models::activations_json({3 * e + 4, 3 * e + c.n_head + e + 2 * c.n_inner,
                                              2 * e + 4, c.n_inner, e, e + 2, c.vocab_size},
                                             {4, c.n_head, 4, 0, 2, c.vocab_size});
  }

  static ordered_json hand_config(const Gpt2Config& config) {
    ordered_json hf = meshrun::gpt2::hf_config(config);
    hf["model_type"] = "hand_gpt2";
    return hf;
  }

  static std::string describe(const Gpt2Config& config,
                              const std::vector<ParameterView>& parameters) {
    return meshrun::models::describe_model(
        {{"config", hand_config(config)},
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
         {"activations", activations(config)}},
        parameters, config.n_layer, modules(config));
  }
};

const meshrun_model_api kModelApi = meshrun::plugin::ModelTable<
    meshrun::models::HostModel<Gpt2Plugin>,
    meshrun::models::HostStage<Gpt2Plugin>>::make("hand_gpt2", meshrun::gpt2::kConfigKeys);

const meshrun_plugin_api kApi = meshrun::models::model_plugin_api(
    "hand_gpt2", MESHRUN_PLUGIN_VERSION,
    "the hand-written GPT-2 family, the gpt2 model kit composition's oracle in the tests",
    &kModelApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
