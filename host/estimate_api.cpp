// meshrun_runtime_estimate_json (abi/include/meshrun/host.h): the estimate
// `meshrun plan --estimate --json` prints, for a host's runtime.
#include "estimate/estimate.hpp"
#include "host_api.hpp"
#include "meshrun/host.h"

meshrun_error* meshrun_runtime_estimate_json(const meshrun_runtime* runtime, const char* hardware,
                                             int64_t ranks_per_node, char** out_json) {
  using meshrun::host_api::require;
  return meshrun::host_api::guarded(__func__, [&] {
    meshrun::host_api::live(runtime, "runtime");
    require(hardware, "hardware");
    require(out_json, "out_json");
    if (ranks_per_node < 0) {
      throw meshrun::Error(MESHRUN_INVALID_ARGUMENT, "ranks_per_node must be 0 or more");
    }
    const meshrun::Plan& plan = runtime->runtime.plan();
    const std::string name = hardware;
    const int64_t shared =
        name == "cpu-this-machine" && ranks_per_node == 0 ? plan.mesh.world_size() : ranks_per_node;
    const meshrun::Estimate estimate =
        meshrun::estimate_run(plan, meshrun::hardware_profile(name, shared));
    *out_json = meshrun::host_api::malloc_string(meshrun::estimate_to_json(estimate).dump());
  });
}
