// The Llama sidecar ("ModelParallelizer"): the model-specific plan for
// Hugging Face model_type "llama". In ABI 1.0 its table carries identity and
// the model type only; the plan entry points are appended by a later minor.
#include "meshrun/plugin.hpp"

namespace {

const meshrun_sidecar_api kSidecarApi = {
    sizeof(meshrun_sidecar_api),
    "llama",
    nullptr,
};

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SIDECAR,
    "llama",
    MESHRUN_PLUGIN_VERSION,
    "Llama sidecar: plans sharding units, the tensor-parallel placement and the pipeline split "
    "for model_type llama. ABI 1.0 table: identity only, the plan is not yet implemented",
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    nullptr,
    &kSidecarApi,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
