// The Mixtral model plugin (meshrun/model.h, model_type "mixtral"), composed
// from the model kit (meshrun/kit.h): Hugging Face's MixtralForCausalLM
// layer as a list of the kit's layers — Llama's attention half and a sparse
// mixture of SwiGLU experts (MOE_MLP) in place of its MLP — over the
// [model] keys, defaults and checks of mixtral/model.hpp. The kit computes
// it, experts spread over the ep ranks; the hand-written Mixtral family
// (mixtral/moe.hpp) is its oracle in the tests (tests/kit: equal bit for
// bit).
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "common/config_reader.hpp"
#include "meshrun/kit.h"
#include "meshrun/plugin.hpp"
#include "mixtral/model.hpp"

namespace {

using meshrun::mixtral::MixtralConfig;

const meshrun_kit_op kLayer[] = {
    {MESHRUN_KIT_RMSNORM, 0, "input_layernorm", "x", nullptr, "n1"},
    {MESHRUN_KIT_ATTENTION, 0, "self_attn", "n1", nullptr, "a"},
    {MESHRUN_KIT_ADD, 0, nullptr, "x", "a", "h"},
    {MESHRUN_KIT_RMSNORM, 0, "post_attention_layernorm", "h", nullptr, "n2"},
    {MESHRUN_KIT_MOE_MLP, 0, "block_sparse_moe", "n2", nullptr, "m"},
    {MESHRUN_KIT_ADD, 0, nullptr, "h", "m", "out"},
};

meshrun_error* compose(const meshrun_kit_config* config, meshrun_kit_model_spec* spec) {
  if (!MESHRUN_HAS_FIELD(meshrun_kit_model_spec, spec, router_aux_loss_coef)) {
    return meshrun::plugin::make_error(
        MESHRUN_UNIMPLEMENTED, "mixtral needs the model kit 1.2 or later (libmeshrun_kit.so)");
  }
  std::string config_json;
  try {
    const MixtralConfig c = meshrun::mixtral::read_config(
        meshrun::models::ConfigReader(meshrun_kit_config_json(config)));
    meshrun::llama::set_kit_decoder(c, *spec);
    spec->num_local_experts = c.num_local_experts;
    spec->num_experts_per_tok = c.num_experts_per_tok;
    spec->router_aux_loss_coef = c.router_aux_loss_coef;
    config_json = meshrun::mixtral::hf_config(c).dump();
  } catch (const std::invalid_argument& e) {
    return meshrun::plugin::make_error(MESHRUN_INVALID_ARGUMENT, e.what());
  }
  spec->num_ops = sizeof kLayer / sizeof kLayer[0];
  spec->ops = kLayer;
  spec->architecture = "MixtralForCausalLM";
  spec->layer_class = "MixtralDecoderLayer";
  spec->config_json = meshrun_kit_config_keep(config, config_json.c_str());
  return nullptr;
}

const meshrun_kit_plugin mixtral = {
    sizeof(meshrun_kit_plugin),
    "mixtral",
    MESHRUN_PLUGIN_VERSION,
    "Mixtral (MixtralForCausalLM), composed from the model kit: Llama's attention with a sparse "
    "mixture of SwiGLU experts, top-k routing and the load-balancing loss; experts spread over "
    "the ep ranks (all-to-all dispatch and combine); pipeline stages with split backward",
    meshrun::mixtral::config_keys().data(),
    compose};

}  // namespace

MESHRUN_KIT_DEFINE_PLUGIN(mixtral)
