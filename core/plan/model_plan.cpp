// Asks the model sidecar for the model's plan (meshrun/sidecar.h): builds
// the request from the config, the mesh and the schedule, and turns a
// sidecar's "key: reason" error into one that points at the key in the file.
#include <fmt/format.h>

#include "errors.hpp"
#include "meshrun/sidecar.h"
#include "plan/plan.hpp"
#include "plugin/call_scope.hpp"

namespace meshrun {
namespace {

nlohmann::ordered_json request_of(const Config& config, const MeshContext& mesh,
                                  const PluginLibrary* schedule) {
  const ModelConfig& m = config.model;
  const DistributedConfig& d = config.distributed;
  nlohmann::ordered_json pipeline = {
      {"stages_per_rank", schedule ? schedule->api().schedule->stages_per_rank : 1},
      {"placement",
       schedule && schedule->api().schedule->placement == MESHRUN_PLACEMENT_V ? "v" : "loop"},
      {"layers_per_stage", d.pipeline.layers_per_stage},
      {"round_virtual_stages_to_pp_multiple", d.pipeline.round_virtual_stages_to_pp_multiple},
      {"module_fqns_per_model_part", d.pipeline.module_fqns_per_model_part}};
  return {{"model",
           {{"model_type", m.model_type},
            {"vocab_size", m.vocab_size},
            {"hidden_size", m.hidden_size},
            {"intermediate_size", m.intermediate_size},
            {"num_hidden_layers", m.num_hidden_layers},
            {"num_attention_heads", m.num_attention_heads},
            {"num_key_value_heads", m.num_key_value_heads},
            {"tie_word_embeddings", m.tie_word_embeddings}}},
          {"mesh",
           {{"pp", mesh.axis_size(Axis::pp)},
            {"dp_replicate", mesh.axis_size(Axis::dp_replicate)},
            {"dp_shard", mesh.axis_size(Axis::dp_shard)},
            {"cp", mesh.axis_size(Axis::cp)},
            {"tp", mesh.axis_size(Axis::tp)},
            {"ep", mesh.axis_size(Axis::ep)}}},
          {"sequence_parallel", d.sequence_parallel},
          {"activation_checkpointing", d.activation_checkpointing},
          {"pipeline", std::move(pipeline)}};
}

// The sidecar's message starts with the dotted key it concerns.
[[noreturn]] void rethrow_at_key(const Config& config, int32_t code, const std::string& message) {
  const auto colon = message.find(": ");
  const std::string key = colon == std::string::npos ? "model" : message.substr(0, colon);
  throw Error(code, config.where(key) + ": " + message, key);
}

}  // namespace

nlohmann::ordered_json plan_model(const Config& config, const MeshContext& mesh,
                                  const std::shared_ptr<PluginLibrary>& sidecar,
                                  const PluginLibrary* schedule) {
  const meshrun_sidecar_api& api = *sidecar->api().sidecar;
  if (!MESHRUN_HAS_FIELD(meshrun_sidecar_api, &api, plan) || api.plan == nullptr) return nullptr;
  const PluginInstance instance(sidecar);
  const std::string request = request_of(config, mesh, schedule).dump();
  char* plan_json = nullptr;
  meshrun_error* error = call_plugin(
      *sidecar, "plan", [&] { return api.plan(instance.handle(), request.c_str(), &plan_json); });
  if (error != nullptr) {
    const int32_t code = error->code;
    const std::string message = error->message != nullptr ? error->message : "";
    meshrun_error_release(error);
    rethrow_at_key(config, code, message);
  }
  const std::string text = plan_json;
  host_services().deallocate(host_services().context, plan_json);
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(MESHRUN_INTERNAL, fmt::format("sidecar {} returned a plan that is not JSON: {}",
                                              sidecar->path(), e.what()));
  }
}

}  // namespace meshrun
