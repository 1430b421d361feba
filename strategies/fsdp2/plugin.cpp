// The fsdp2 plugin: PyTorch FSDP2 (fully_shard) semantics, as NeMo
// AutoModel configures it, on the sharding engine (sharding/engine.hpp);
// its table has every entry point of ABI 1.3, errors named "fsdp2".
#include "common/table.hpp"
#include "options.hpp"

namespace {

class Fsdp2 : public meshrun::sharding::Engine {
 public:
  static constexpr const char* kName = "fsdp2";
  explicit Fsdp2(const meshrun_host_services& host)
      : Engine(host, kName, &meshrun::fsdp2::parse_options) {}
};

const meshrun_strategy_api kStrategyApi =
    meshrun::strategies::sharded_strategy_table<Fsdp2>(MESHRUN_MESH_FAMILY_FSDP2);

const meshrun_plugin_api kApi = meshrun::strategies::strategy_plugin_table<Fsdp2>(
    Fsdp2::kName, MESHRUN_PLUGIN_VERSION,
    "FSDP2: shards float32 master parameters and gradients by rows over dp_shard_cp; "
    "all-gathers each unit (in mp_policy.param_dtype) before its forward and backward, with "
    "prefetch (enable_fsdp2_prefetch, fsdp2_forward/backward_prefetch_depth), and reshards "
    "after (reshard_after_forward, AutoModel's heuristic when unset); reduce-scatters "
    "(averages) each unit's gradients in mp_policy.reduce_dtype after its backward, "
    "overlapping the units that follow, then all-reduces them over dp_replicate (HSDP); "
    "defer_fsdp_grad_sync keeps non-sync micro-batches' gradients unreduced; host memory "
    "(CPU comm backends) only",
    &kStrategyApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
