// The strategy plugins fsdp2 and megatron_fsdp, whose tables still carry
// their identity and mesh family only (ABI 1.0 size: no training entry
// points yet), so the two differ by data alone: this file is built once per
// strategy, and MESHRUN_STRATEGY_NAME picks its row of kStrategies. ddp has
// its own folder, strategies/ddp/.
#include <cstddef>
#include <iterator>
#include <string_view>

#include "meshrun/plugin.hpp"

namespace {

struct StrategyFacts {
  std::string_view name;
  int32_t mesh_family;
  const char* description;
};

constexpr StrategyFacts kStrategies[] = {
    {"fsdp2", MESHRUN_MESH_FAMILY_FSDP2,
     "FSDP2: shards parameters, gradients and optimizer state over dp_shard_cp, all-gathering "
     "each unit before it runs and reduce-scattering its gradients; HSDP over dp_replicate; "
     "composes with tp, pp, cp and ep. ABI 1.0 table: mesh rules only, hooks not yet "
     "implemented"},
    {"megatron_fsdp", MESHRUN_MESH_FAMILY_MEGATRON_FSDP,
     "Megatron-FSDP: ZeRO-style sharding (zero_dp_strategy 0-3) over dp with contiguous, "
     "bucketed, overlapped all-gather and reduce-scatter; mesh (dp, cp, tp), no pp or ep. "
     "ABI 1.0 table: mesh rules only, hooks not yet implemented"},
};

constexpr size_t row_of(std::string_view name) {
  size_t row = 0;
  while (row < std::size(kStrategies) && kStrategies[row].name != name) ++row;
  return row;
}

constexpr size_t kRow = row_of(MESHRUN_STRATEGY_NAME);
static_assert(kRow < std::size(kStrategies), "MESHRUN_STRATEGY_NAME names no row of kStrategies");

// An ABI 1.0-sized table: the mesh rules only. The training entry points of
// ABI 1.2 lie beyond its struct_size, so a host knows they are absent.
const meshrun_strategy_api kStrategyApi = [] {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_0;
  api.mesh_family = kStrategies[kRow].mesh_family;
  return api;
}();

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_STRATEGY,
    MESHRUN_STRATEGY_NAME,
    MESHRUN_PLUGIN_VERSION,
    kStrategies[kRow].description,
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    &kStrategyApi,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
