// A schedule plugin's compute order (meshrun/schedule.h, ABI 1.4), turned
// into a Schedule and checked: what a plugin returns is not trusted to be
// valid, since third-party schedules come through the same door.
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "errors.hpp"
#include "meshrun/schedule.h"
#include "plugin/call_scope.hpp"
#include "schedule/schedule.hpp"

namespace meshrun::schedule {
namespace {

// A plugin instance for one call; the plugin's error, if create fails,
// becomes a meshrun::Error naming the plugin.
struct InstanceDeleter {
  const PluginLibrary* plugin;
  void operator()(meshrun_plugin_instance* instance) const {
    call_plugin(*plugin, "destroy", [&] { plugin->api().destroy(instance); });
  }
};
using InstanceHandle = std::unique_ptr<meshrun_plugin_instance, InstanceDeleter>;

InstanceHandle create_instance(const PluginLibrary& plugin) {
  meshrun_plugin_instance* instance = nullptr;
  if (meshrun_error* error = call_plugin(
          plugin, "create", [&] { return plugin.api().create(&host_services(), &instance); })) {
    throw take_plugin_error(plugin, "create failed", error);
  }
  return InstanceHandle(instance, InstanceDeleter{&plugin});
}

// The plugin's JSON text, freed through the host services that allocated it.
std::string call_generate(const PluginLibrary& plugin, int64_t pp, int64_t stages_per_rank,
                          int64_t microbatches, const std::string& options_json) {
  const meshrun_schedule_api& api = *plugin.api().schedule;
  if (!MESHRUN_HAS_FIELD(meshrun_schedule_api, &api, generate) || api.generate == nullptr) {
    throw Error(MESHRUN_UNIMPLEMENTED,
                fmt::format("schedule plugin {} ({}) cannot generate actions: its table has no "
                            "generate entry (ABI 1.4)",
                            plugin.name(), plugin.path()));
  }
  const InstanceHandle instance = create_instance(plugin);
  char* text = nullptr;
  if (meshrun_error* error = call_plugin(plugin, "generate", [&] {
        return api.generate(instance.get(), pp, stages_per_rank, microbatches, options_json.c_str(),
                            &text);
      })) {
    throw take_plugin_error(plugin, "generate", error);
  }
  if (text == nullptr) {
    throw Error(MESHRUN_INTERNAL,
                fmt::format("plugin {}: generate returned no actions", plugin.path()));
  }
  std::string copy = text;
  host_services().deallocate(host_services().context, text);
  return copy;
}

[[noreturn]] void malformed(const PluginLibrary& plugin, const std::string& what) {
  throw Error(MESHRUN_INTERNAL, fmt::format("plugin {}: generate returned an invalid schedule: {}",
                                            plugin.path(), what));
}

// {"actions": [[string, ...], ...]} with one list per rank.
std::vector<std::vector<std::optional<Action>>> parse_ranks(const PluginLibrary& plugin,
                                                            const std::string& text, int64_t pp) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    malformed(plugin, std::string("not JSON: ") + e.what());
  }
  const auto actions = json.is_object() ? json.find("actions") : json.end();
  if (actions == json.end() || !actions->is_array() || actions->size() != static_cast<size_t>(pp)) {
    malformed(plugin, fmt::format("it must be an object whose \"actions\" holds {} lists", pp));
  }
  std::vector<std::vector<std::optional<Action>>> ranks(static_cast<size_t>(pp));
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const nlohmann::json& list = (*actions)[rank];
    if (!list.is_array()) malformed(plugin, fmt::format("rank {}: not a list", rank));
    ranks[rank].reserve(list.size());
    for (const nlohmann::json& entry : list) {
      const std::optional<Action> action =
          entry.is_string() ? parse_action(entry.get_ref<const std::string&>()) : std::nullopt;
      if (!action || !is_compute(action->type)) {
        malformed(plugin, fmt::format("rank {} step {}: {} is not a compute action", rank,
                                      ranks[rank].size(), entry.dump()));
      }
      ranks[rank].push_back(action);
    }
  }
  return ranks;
}

}  // namespace

Schedule generate(const PluginLibrary& schedule_plugin, int64_t pp, int64_t stages_per_rank,
                  int64_t microbatches, const std::string& options_json) {
  const std::string text =
      call_generate(schedule_plugin, pp, stages_per_rank, microbatches, options_json);
  Schedule schedule;
  schedule.name = std::string(schedule_plugin.name());
  schedule.pp = pp;
  schedule.stages_per_rank = stages_per_rank;
  schedule.microbatches = microbatches;
  schedule.stage_rank = schedule_plugin.api().schedule->placement == MESHRUN_PLACEMENT_V
                            ? v_placement(pp)
                            : loop_placement(pp, stages_per_rank);
  if (static_cast<int64_t>(schedule.stage_rank.size()) != pp * stages_per_rank) {
    malformed(schedule_plugin, fmt::format("V placement holds 2 stages per rank, the plugin "
                                           "accepted {}",
                                           stages_per_rank));
  }
  schedule.ranks = parse_ranks(schedule_plugin, text, pp);
  try {
    validate_compute(schedule);
  } catch (const Error& e) {
    malformed(schedule_plugin, e.what());
  }
  return schedule;
}

}  // namespace meshrun::schedule
