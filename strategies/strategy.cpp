// The megatron_fsdp strategy plugin, whose table still carries its identity
// and mesh family only (ABI 1.0 size: no training entry points yet), so that
// `meshrun plan` can resolve its mesh. ddp and fsdp2 have folders of their
// own (strategies/ddp/, strategies/fsdp2/).
#include "common/table.hpp"

namespace {

// An ABI 1.0-sized table: the mesh rules only. The training entry points of
// ABI 1.2 lie beyond its struct_size, so a host knows they are absent.
const meshrun_strategy_api kStrategyApi = [] {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_0;
  api.mesh_family = MESHRUN_MESH_FAMILY_MEGATRON_FSDP;
  return api;
}();

const meshrun_plugin_api kApi =
    meshrun::strategies::strategy_plugin_table<meshrun::plugin::HostServicesOnly>(
        "megatron_fsdp", MESHRUN_PLUGIN_VERSION,
        "Megatron-FSDP: ZeRO-style sharding (zero_dp_strategy 0-3) over dp with contiguous, "
        "bucketed, overlapped all-gather and reduce-scatter; mesh (dp, cp, tp), no pp or ep. "
        "ABI 1.0 table: mesh rules only, hooks not yet implemented",
        &kStrategyApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
