// The plan: what a run would do on a given world size, as data — the mesh,
// the plugins that would be loaded (and from which file), and the rank layout.
// `meshrun plan` prints it; the host API returns it as JSON.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "mesh/mesh.hpp"
#include "model/model.hpp"
#include "model/tensor_parallel.hpp"
#include "plugin/loader.hpp"
#include "strategy/strategy.hpp"

namespace meshrun {

struct Plan {
  const Config* config = nullptr;
  MeshContext mesh;
  std::shared_ptr<PluginLibrary> strategy;
  std::shared_ptr<const Model> model;       // the model plugin, configured; null: no model planned
  std::shared_ptr<PluginLibrary> sidecar;   // null: the model has no sidecar installed
  std::shared_ptr<PluginLibrary> schedule;  // null without a pipeline (pp_size 1)
  // The plan of the model (docs/plan.md): units, parameter placement,
  // pipeline split, checkpointing; the default plan, or the sidecar's.
  nlohmann::ordered_json model_plan;
  // The model plan's placement of the parameters over tp ranks; null
  // without a model.
  std::shared_ptr<const TensorParallelLayout> tensor_parallel;
};

// Loads the strategy, model, sidecar (when the model family has one) and
// (with pp_size > 1) schedule plugins the config names, resolves the mesh
// with the strategy's mesh family and plans the model — unless `with_model`
// is false (a host program that computes its own model). Errors are
// prefixed with the position of the key they concern.
Plan make_plan(const Config& config, int64_t world_size, const PluginLoader& loader,
               bool with_model = true);

// The dtype the model's matmuls compute in (the plan's "autocast_dtype",
// null there for "float32"): distributed.autocast_dtype when set; otherwise
// FSDP2's mp_policy.param_dtype where the model computes its matmuls in it
// (its description's "autocast_dtypes"): weights gathered in bfloat16 are
// multiplied in bfloat16, as torch's FSDP2 does (docs/decisions.md,
// "bfloat16 parameters compute in bfloat16"); else "float32".
std::string matmul_dtype(const Config& config, const ModelDescription& description);

// The plan of `model` on `mesh`: the default plan (units from the model's
// description, AutoModel's pipeline split), or `sidecar`'s refinement of it,
// checked against the description. Errors carry the config key they concern.
nlohmann::ordered_json plan_model(const Config& config, const MeshContext& mesh, const Model& model,
                                  const std::shared_ptr<PluginLibrary>& sidecar,
                                  const PluginLibrary* schedule);

// How context parallelism shares attention over cp_size ranks: ring x
// Ulysses (distributed.cp_ring_degree, cp_ulysses_degree; one may be left
// out, ring when both are). Throws an input error naming the key when
// they do not multiply to cp_size.
struct ContextParallelDegrees {
  int64_t ring = 1, ulysses = 1;
};
ContextParallelDegrees context_parallel_degrees(const Config& config);

// Loads the strategy plugin the config names; its table says the mesh family.
std::shared_ptr<PluginLibrary> load_strategy(const Config& config, const PluginLoader& loader);

// Resolves the mesh for `world_size` with the given strategy plugin's family.
MeshContext resolve_config_mesh(const Config& config, int64_t world_size,
                                const PluginLibrary& strategy);

// The world size used when none is given: tp * cp * pp times the explicit
// dp_size, or else the smallest dp the dp_replicate and ep rules allow.
int64_t default_world_size(const Config& config);

// The microbatches of one pipeline step: this rank's share of the global
// batch in pp_microbatch_size pieces.
int64_t pipeline_microbatches(const Config& config, int64_t dp);

// What the strategy predicts a rank holds for the whole tp-local model
// (its plan_memory; see plan_strategy_memory). Needs a model.
std::optional<StrategyMemoryPlan> predict_state_memory(const Plan& plan);

// Where rank `rank` of a run with `ranks_per_node` ranks a node (0: every
// rank on one node) computes: "cpu", or for a CUDA run "cuda:N" with N its
// local rank (the launch fills each node's ranks in order, and a CUDA run
// has a GPU per local rank: mesh/device.hpp).
std::string rank_device(const Plan& plan, int64_t rank, int64_t ranks_per_node);

// The plan JSON of docs/design.md. Rank coordinates (with each rank's node
// and device in a CUDA run, for `ranks_per_node` ranks a node, 0: one node)
// are listed up to 4096 ranks, or always with `all_ranks`.
nlohmann::ordered_json plan_to_json(const Plan& plan, bool all_ranks, int64_t ranks_per_node = 0);

// The human-readable plan; large worlds show the first and last ranks only,
// unless `all_ranks`. A CUDA run's rank table has each rank's node and GPU.
std::string plan_to_text(const Plan& plan, bool all_ranks, int64_t ranks_per_node = 0);

}  // namespace meshrun
