// The test sidecars: a plan entry that behaves in the one way each plugin's
// name says (plugin_name.hpp):
//   crashy       dereferences NULL in plan, for the CLI's crash report;
//   other_model  refuses every request, as a sidecar of another model family
//                may refuse a Llama-shaped one: conformance passes it;
//   no_units     answers with a plan without units: conformance refuses it;
//   empty_plan   answers {};
//   not_json     answers with text that is not JSON;
//   mismatch     answers with the default plan, one unit renamed: a plan
//                that does not fit its model.
// All but other_model have a test model of the same name (test_model.cpp).
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "meshrun/plugin.hpp"
#include "plugin_name.hpp"

namespace {

using test_plugins::kPluginName;

const std::string_view kName = kPluginName;

using meshrun::plugin::Error;

// Volatile, so that the compiler keeps the crash.
int* volatile nowhere = nullptr;

// Unchecked by UBSan in a sanitized build, which would stop the store with
// its own report before it raises the signal under test.
__attribute__((no_sanitize("undefined"))) void crash() { *nowhere = 1; }

meshrun_error* plan(meshrun_plugin_instance* instance, const char* request_json, char** out) {
  return meshrun::plugin::guard([&] {
    if (instance == nullptr || request_json == nullptr || out == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "plan: instance, request_json and out must not be NULL");
    }
    if (kName == "crashy") crash();
    if (!nlohmann::json::accept(request_json)) {
      throw Error(MESHRUN_INVALID_ARGUMENT, "plan: the request is not JSON");
    }
    if (kName == "other_model") {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "model.model_type: this sidecar plans other_model models only");
    }
    std::string text = R"({"parameters": []})";
    if (kName == "empty_plan") text = "{}";
    if (kName == "not_json") text = "this is not a plan";
    if (kName == "mismatch") {
      nlohmann::json plan = nlohmann::json::parse(request_json).at("default_plan");
      plan["units"][1]["name"] = "layers.9";
      text = plan.dump();
    }
    const auto& host = reinterpret_cast<meshrun::plugin::HostServicesOnly*>(instance)->host();
    auto* copy = static_cast<char*>(host.allocate(host.context, text.size() + 1, 1));
    if (copy == nullptr) throw Error(MESHRUN_INTERNAL, "plan: out of memory");
    std::memcpy(copy, text.c_str(), text.size() + 1);
    *out = copy;
  });
}

const std::string kDescription = std::string("test sidecar: ") + kPluginName;

const meshrun_sidecar_api kSidecarApi = [] {
  meshrun_sidecar_api api{};
  api.struct_size = MESHRUN_SIDECAR_API_SIZE_1_2;
  api.model_type = kPluginName;
  api.plan = &plan;
  return api;
}();

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_SIDECAR,
    kPluginName,
    "0.0.1-test",
    kDescription.c_str(),
    &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    nullptr,
    nullptr,
    &kSidecarApi,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
