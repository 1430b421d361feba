// The Llama model plugin (meshrun/model.h, model_type "llama"), composed
// from the model kit (meshrun/kit.h): Hugging Face's LlamaForCausalLM layer
// as a list of the kit's layers, over the [model] keys, defaults and checks
// of llama/model.hpp. The kit computes it; the hand-written Llama family
// (llama/decoder.hpp), which Mixtral builds on, is its oracle in the tests
// (tests/kit: equal bit for bit under every parallelism).
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "common/config_reader.hpp"
#include "llama/model.hpp"
#include "meshrun/kit.h"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::llama::LlamaConfig;

const meshrun_kit_op kLayer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, 0, "self_attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", nullptr, "n2"},
    {MESHRUN_KIT_SWIGLU_MLP, 0, "mlp", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

// Hugging Face's config.json keys beyond the sizes, resolved.
std::string hf_config(const LlamaConfig& c) {
  return nlohmann::ordered_json{{"head_dim", c.hidden_size / c.num_attention_heads},
                                {"hidden_act", "silu"},
                                {"max_position_embeddings", c.max_position_embeddings},
                                {"rms_norm_eps", c.rms_norm_eps},
                                {"rope_theta", c.rope_theta},
                                {"attention_bias", false},
                                {"mlp_bias", false}}
      .dump();
}

meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  std::string config_json;
  try {
    const LlamaConfig c = meshrun::llama::read_decoder_config(
        meshrun::models::ConfigReader(meshrun_kit_config_json(config)), {});
    meshrun::llama::set_kit_decoder(c, *spec);
    config_json = hf_config(c);
  } catch (const std::invalid_argument& e) {
    return meshrun::plugin::make_error(MESHRUN_INVALID_ARGUMENT, e.what());
  }
  spec->num_ops = sizeof kLayer / sizeof kLayer[0];
  spec->ops = kLayer;
  spec->architecture = "LlamaForCausalLM";
  spec->layer_class = "LlamaDecoderLayer";
  spec->config_json = meshrun_kit_config_keep(config, config_json.c_str());
  return nullptr;
}

const meshrun_kit_plugin llama = {
    sizeof(meshrun_kit_plugin),
    "llama",
    MESHRUN_PLUGIN_VERSION,
    "Llama (LlamaForCausalLM), composed from the model kit: RMSNorm, rotary attention with "
    "grouped key/value heads, SwiGLU; GEMMs through oneDNN in float32 or bfloat16; pipeline "
    "stages with split backward",
    meshrun::llama::kDecoderConfigKeys,
    compose};

}  // namespace

MESHRUN_KIT_DEFINE_PLUGIN(llama)
