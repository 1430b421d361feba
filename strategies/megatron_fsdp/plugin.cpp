// The megatron_fsdp plugin: Megatron-FSDP's ZeRO levels (zero_dp_strategy
// 0-3) on the sharding engine (sharding/engine.hpp), over the (dp, cp, tp)
// mesh; its table has every entry point of ABI 1.3, errors named
// "megatron_fsdp".
#include "common/table.hpp"
#include "options.hpp"

namespace {

class MegatronFsdp : public meshrun::sharding::Engine {
 public:
  static constexpr const char* kName = "megatron_fsdp";
  explicit MegatronFsdp(const meshrun_host_services& host)
      : Engine(host, kName, &meshrun::megatron_fsdp::parse_options) {}

  void setup(const meshrun_strategy_setup* setup) {
    Engine::setup(setup);
    int64_t rank = 0;
    setup->comm->rank(setup->data_parallel, &rank);
    if (rank == 0 && meshrun::megatron_fsdp::checks_for_nan_in_grad(setup->options_json)) {
      log(MESHRUN_LOG_WARNING,
          "check_for_nan_in_grad has no effect (megatron-fsdp 0.5.0); "
          "report_nan_in_param_grad = true checks each parameter's gradient");
    }
  }
};

const meshrun_strategy_api kStrategyApi =
    meshrun::strategies::sharded_strategy_table<MegatronFsdp>(MESHRUN_MESH_FAMILY_MEGATRON_FSDP);

const meshrun_plugin_api kApi = meshrun::strategies::strategy_plugin_table<MegatronFsdp>(
    MegatronFsdp::kName, MESHRUN_PLUGIN_VERSION,
    "Megatron-FSDP: ZeRO sharding over dp (dp_shard_cp) of float32 master parameters in "
    "contiguous per-unit buffers: zero_dp_strategy 0 replicates everything (the mesh puts dp on "
    "dp_replicate; gradients all-reduced once per step), 1 shards the optimizer state "
    "(parameters gathered once per step, gradients reduce-scattered once), 2 also the gradients "
    "(each micro-batch reduce-scatters), 3 also the parameters (each unit gathered around its "
    "forward and backward); overlap_grad_reduce and overlap_param_gather overlap the collectives "
    "with compute; mesh (dp, cp, tp), no pp or ep; host memory (CPU comm backends) only",
    &kStrategyApi);

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
