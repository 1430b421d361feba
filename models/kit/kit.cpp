// libmeshrun_kit.so: meshrun/kit.h's functions. A kit plugin's model is a
// HostModel of the composition its compose call returns, and its stages
// the shipped families' driver (common/host_stage.hpp) over the Composed
// family, on the host's compute or a CUDA GPU's (kit/stage_compute.hpp).
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/config_reader.hpp"
#include "common/host_stage.hpp"
#include "kit/composed.hpp"
#include "kit/composition.hpp"
#include "kit/stage_compute.hpp"
#include "meshrun/kit.h"

struct meshrun_kit_config {
  meshrun::models::ConfigReader reader;
  const char* json;
  // meshrun_kit_config_keep's copies; a list, so that each stays put.
  mutable std::list<std::string> kept;
};

namespace {

using meshrun::kit::Composition;
using meshrun::plugin::Error;
using meshrun::plugin::guard;

struct KitPlugin {
  using Family = meshrun::kit::Composed;
  static std::string describe(const Composition& c,
                              const std::vector<meshrun::models::ParameterView>& parameters) {
    return meshrun::kit::describe(c, parameters, meshrun::kit::cuda_compute_installed());
  }
  static std::unique_ptr<meshrun::models::Compute> make_compute(
      const meshrun_model_stage_setup& setup) {
    return meshrun::kit::make_cuda_compute(meshrun::plugin::stage_device(setup),
                                           setup.compute_stream);
  }
  static meshrun::models::ModelModules modules(const Composition& c) {
    return meshrun::kit::modules(c);
  }
};

using KitModel = meshrun::models::HostModel<KitPlugin>;
using KitStage = meshrun::models::HostStage<KitPlugin>;

void require(bool condition, const char* what) {
  if (!condition) throw Error(MESHRUN_INVALID_ARGUMENT, std::string(what) + " is NULL");
}

// Runs the plugin's compose over the config, then checks what it made.
Composition composed(const meshrun_kit_plugin& plugin, const char* config_json) {
  const meshrun_kit_config config{meshrun::models::ConfigReader(config_json), config_json, {}};
  meshrun_kit_model_spec spec = meshrun::kit::default_spec();
  if (meshrun_error* error = plugin.compose(&config, &spec)) {
    throw meshrun::plugin::HostError(error);
  }
  return meshrun::kit::compose(spec, plugin.model_type, nlohmann::ordered_json::parse(config_json));
}

// A plugin's tables, made on its first meshrun_plugin_get_api call.
struct Tables {
  meshrun_model_api model;
  meshrun_plugin_api plugin;
};

template <class Read>
meshrun_error* read_config(const meshrun_kit_config* config, const char* key, Read&& read) {
  return guard([&] {
    require(config != nullptr && key != nullptr, "meshrun_kit_config_*: config or key");
    try {
      read(config->reader);
    } catch (const std::invalid_argument& e) {
      throw Error(MESHRUN_INVALID_ARGUMENT, e.what());
    }
  });
}

}  // namespace

extern "C" {

MESHRUN_KIT_EXPORT uint32_t meshrun_kit_version(void) {
  return uint32_t(MESHRUN_KIT_VERSION_MAJOR) << 16 | uint32_t(MESHRUN_KIT_VERSION_MINOR);
}

MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_integer(const meshrun_kit_config* config,
                                                             const char* key, int64_t fallback,
                                                             int64_t min, int64_t max,
                                                             int64_t* out) {
  return read_config(config, key, [&](const meshrun::models::ConfigReader& reader) {
    require(out != nullptr, "meshrun_kit_config_integer: out");
    *out = reader.integer(key, fallback, min, max);
  });
}

MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_positive(const meshrun_kit_config* config,
                                                              const char* key, double fallback,
                                                              double* out) {
  return read_config(config, key, [&](const meshrun::models::ConfigReader& reader) {
    require(out != nullptr, "meshrun_kit_config_positive: out");
    *out = reader.positive_number(key, fallback);
  });
}

MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_config_boolean(const meshrun_kit_config* config,
                                                             const char* key, int32_t fallback,
                                                             int32_t* out) {
  return read_config(config, key, [&](const meshrun::models::ConfigReader& reader) {
    require(out != nullptr, "meshrun_kit_config_boolean: out");
    *out = reader.boolean(key, fallback != 0) ? 1 : 0;
  });
}

MESHRUN_KIT_EXPORT const char* meshrun_kit_config_json(const meshrun_kit_config* config) {
  return config != nullptr ? config->json : nullptr;
}

MESHRUN_KIT_EXPORT const char* meshrun_kit_config_keep(const meshrun_kit_config* config,
                                                       const char* text) {
  if (config == nullptr || text == nullptr) return nullptr;
  try {
    return config->kept.emplace_back(text).c_str();
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

MESHRUN_KIT_EXPORT meshrun_error* meshrun_kit_model_create(const meshrun_kit_plugin* plugin,
                                                           meshrun_plugin_instance* instance,
                                                           const char* config_json,
                                                           meshrun_model** out) {
  return guard([&] {
    require(plugin != nullptr && plugin->compose != nullptr, "meshrun_kit_model_create: plugin");
    require(instance != nullptr && config_json != nullptr && out != nullptr,
            "model_create: instance, config_json or out");
    const auto& host = reinterpret_cast<meshrun::plugin::HostServicesOnly*>(instance)->host();
    try {
      *out = reinterpret_cast<meshrun_model*>(new KitModel(host, composed(*plugin, config_json)));
    } catch (const std::invalid_argument& e) {
      throw Error(MESHRUN_INVALID_ARGUMENT, e.what());
    }
  });
}

MESHRUN_KIT_EXPORT const meshrun_plugin_api* meshrun_kit_plugin_api(
    const meshrun_kit_plugin* plugin,
    meshrun_error* (*model_create)(meshrun_plugin_instance*, const char*, meshrun_model**)) {
  if (plugin == nullptr || model_create == nullptr) return nullptr;
  static std::mutex mutex;
  static std::map<const meshrun_kit_plugin*, std::unique_ptr<Tables>> made;
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<Tables>& tables = made[plugin];
  if (!tables) {
    tables = std::make_unique<Tables>();
    tables->model = meshrun::plugin::ModelTable<KitModel, KitStage>::make(plugin->model_type,
                                                                          plugin->config_keys);
    tables->model.model_create = model_create;
    tables->plugin = meshrun::models::model_plugin_api(plugin->model_type, plugin->version,
                                                       plugin->description, &tables->model);
  }
  return &tables->plugin;
}

}  // extern "C"
