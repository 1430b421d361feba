// The loader's C++ test plugins: one valid ABI 1.0 strategy table, changed in
// the one way each plugin's name says (plugin_name.hpp). Each is built with
// meshrun_add_plugin into the test-plugin folder, never the shipped one.
#include <string>
#include <string_view>

#include "meshrun/plugin.hpp"
#include "plugin_name.hpp"

namespace {

using test_plugins::kPluginName;

const std::string_view kName = kPluginName;
const std::string kDescription = std::string("loader test plugin: ") + kPluginName;

class Instance {
 public:
  explicit Instance(const meshrun_host_services& /*host*/) {}
};

// create_fails: set-up fails with this code and message. Its errors count
// their own destruction, and the count is published through an extension of
// the plugin table, so a test can see that the host released the error
// through the plugin's destroy and not its own.
constexpr int32_t kCreateFailsCode = MESHRUN_UNAVAILABLE;
constexpr const char* kCreateFailsMessage = "test plugin: no device available";
constexpr int32_t kErrorCounterExtension = 0x7e57;

int32_t destroyed_errors = 0;

struct ErrorCounter {
  meshrun_extension header;
  const int32_t* destroyed_errors;
};

const ErrorCounter kErrorCounter = {
    {sizeof(ErrorCounter), kErrorCounterExtension, nullptr},
    &destroyed_errors,
};

struct CountedError {
  meshrun_error header;
  std::string text;
};

void destroy_counted_error(meshrun_error* error) {
  ++destroyed_errors;
  delete reinterpret_cast<CountedError*>(error);
}

meshrun_error* failing_create(const meshrun_host_services* /*host*/,
                              meshrun_plugin_instance** /*out*/) {
  auto* error =
      new CountedError{{sizeof(CountedError), kCreateFailsCode, nullptr, &destroy_counted_error},
                       kCreateFailsMessage};
  error->header.message = error->text.c_str();
  return &error->header;
}

// null_instance: create checks its arguments like any other, then reports
// success without making an instance.
meshrun_error* create_without_instance(const meshrun_host_services* host,
                                       meshrun_plugin_instance** out) noexcept {
  return meshrun::plugin::guard([&] {
    if (out == nullptr) throw meshrun::plugin::Error(MESHRUN_INVALID_ARGUMENT, "out is NULL");
    meshrun::plugin::require_host(host);
  });
}

// Built field by field from a zeroed table, so fields appended by later ABI
// minors need no initializer here.
const meshrun_strategy_api kStrategyApi = [] {
  meshrun_strategy_api api{};
  api.struct_size = MESHRUN_STRATEGY_API_SIZE_1_0;
  api.mesh_family = MESHRUN_MESH_FAMILY_FSDP2;
  return api;
}();

// newer_minor: a table from a later 1.x, with fields appended to both tables.
struct NewerStrategyApi {
  meshrun_strategy_api v1_0;
  int64_t appended_later;
};

struct NewerPluginApi {
  meshrun_plugin_api v1_0;
  int64_t appended_later;
};

const NewerStrategyApi kNewerStrategyApi = [] {
  NewerStrategyApi api{};
  api.v1_0.struct_size = sizeof(NewerStrategyApi);
  api.v1_0.mesh_family = MESHRUN_MESH_FAMILY_FSDP2;
  return api;
}();

meshrun_plugin_api make_api() {
  meshrun_plugin_api api = {
      sizeof(meshrun_plugin_api),
      MESHRUN_ABI_VERSION_MAJOR,
      MESHRUN_ABI_VERSION_MINOR,
      MESHRUN_PLUGIN_KIND_STRATEGY,
      kPluginName,
      "0.0.1-test",
      kDescription.c_str(),
      &meshrun::plugin::create_instance<Instance>,
      &meshrun::plugin::destroy_instance<Instance>,
      &kStrategyApi,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
  if (kName == "wrong_major") {
    // A first release of the next major: 2.0.
    api.abi_major = MESHRUN_ABI_VERSION_MAJOR + 1;
    api.abi_minor = 0;
  }
  if (kName == "too_small") api.struct_size = MESHRUN_STRUCT_SIZE(meshrun_plugin_api, description);
  if (kName == "unknown_kind") api.kind = 42;
  if (kName == "name_mismatch") api.name = "another_name";
  if (kName == "no_kind_table") api.strategy = nullptr;
  if (kName == "create_fails") {
    api.create = &failing_create;
    api.extensions = &kErrorCounter.header;
  }
  if (kName == "null_instance") api.create = &create_without_instance;
  if (kName == "newer_minor") {
    api.struct_size = sizeof(NewerPluginApi);
    api.abi_minor = MESHRUN_ABI_VERSION_MINOR + 7;
    api.strategy = &kNewerStrategyApi.v1_0;
  }
  return api;
}

// Every variant sits in the newer_minor layout; the others declare the 1.0
// size. kind_mismatch needs no change here: CMake names its file as a
// schedule.
const NewerPluginApi kApi = {make_api(), 0};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) {
  return kName == "null_table" ? nullptr : &kApi.v1_0;
}
