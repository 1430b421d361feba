// The GPT-2 model plugin (meshrun/model.h, model_type "gpt2"), composed
// from the model kit (meshrun/kit.h): Hugging Face's GPT2LMHeadModel block
// as a list of the kit's layers, in GPT-2's names and Conv1D layout, with
// its learned positions and scaled initialization, over the [model] keys,
// defaults and checks of gpt2/model.hpp. The kit computes it; the
// hand-written GPT-2 family (gpt2/stage.hpp) is its oracle in the tests
// (tests/kit: equal bit for bit under every parallelism).
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "common/config_reader.hpp"
#include "gpt2/model.hpp"
#include "meshrun/kit.h"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::gpt2::Gpt2Config;

const meshrun_kit_op kBlock[] = {
    {MESHRUN_KIT_LAYERNORM, 0, "ln_1", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, MESHRUN_KIT_BIAS_IN | MESHRUN_KIT_BIAS_OUT, "attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_LAYERNORM, 0, "ln_2", "h", nullptr, "n2"},
    {MESHRUN_KIT_GELU_MLP, MESHRUN_KIT_BIAS_IN | MESHRUN_KIT_BIAS_OUT, "mlp", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

// GPT2Config's names of the sizes; it has no grouped key/value heads.
const char* const kSizeKeys = R"({"hidden_size": "n_embd", "intermediate_size": "n_inner",
  "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
  "num_key_value_heads": null, "max_position_embeddings": "n_positions"})";

meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  if (!MESHRUN_HAS_FIELD(meshrun_kit_model_spec, spec, size_keys)) {
    return meshrun::plugin::make_error(MESHRUN_UNIMPLEMENTED,
                                       "gpt2 needs the model kit 1.1 or later (libmeshrun_kit.so)");
  }
  std::string config_json;
  try {
    const Gpt2Config c =
        meshrun::gpt2::read_config(meshrun::models::ConfigReader(meshrun_kit_config_json(config)));
    spec->vocab_size = c.vocab_size;
    spec->hidden_size = c.n_embd;
    spec->intermediate_size = c.n_inner;
    spec->num_hidden_layers = c.n_layer;
    spec->num_attention_heads = c.n_head;
    spec->num_key_value_heads = c.n_head;
    spec->norm_eps = c.layer_norm_epsilon;
    spec->tie_word_embeddings = c.tie_word_embeddings;
    spec->max_position_embeddings = c.n_positions;
    spec->initializer_range = c.initializer_range;
    config_json = meshrun::gpt2::hf_config(c).dump();
  } catch (const std::invalid_argument& e) {
    return meshrun::plugin::make_error(MESHRUN_INVALID_ARGUMENT, e.what());
  }
  spec->final_norm = MESHRUN_KIT_LAYERNORM;
  spec->final_norm_name = "transformer.ln_f";
  spec->embedding_name = "transformer.wte";
  spec->position_embedding_name = "transformer.wpe";
  spec->layers_name = "transformer.h";
  spec->projections = MESHRUN_KIT_CONV1D;
  spec->scale_output_init = 1;
  spec->size_keys = kSizeKeys;
  spec->num_ops = sizeof kBlock / sizeof kBlock[0];
  spec->ops = kBlock;
  spec->architecture = "GPT2LMHeadModel";
  spec->layer_class = "GPT2Block";
  spec->config_json = meshrun_kit_config_keep(config, config_json.c_str());
  return nullptr;
}

const meshrun_kit_plugin gpt2 = {
    sizeof(meshrun_kit_plugin),
    "gpt2",
    MESHRUN_PLUGIN_VERSION,
    "GPT-2 (GPT2LMHeadModel), composed from the model kit: learned positions, pre-LayerNorm "
    "blocks with biases, multi-head attention, gelu_new; GEMMs through oneDNN in float32 or "
    "bfloat16; pipeline stages with split backward",
    meshrun::gpt2::kConfigKeys,
    compose};

}  // namespace

MESHRUN_KIT_DEFINE_PLUGIN(gpt2)
