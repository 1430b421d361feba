// meshrun plan CONFIG [--world-size N] [--nproc-per-node N] [--json] [--all-ranks]
//                     [--estimate [--hardware NAME|FILE.toml] [--model-config config.json]]
//                     [key.path=value ...]
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "estimate/estimate.hpp"
#include "plan/plan.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kPlanUsage =
    "usage: meshrun plan CONFIG.toml [--world-size N] [--nproc-per-node N] [--json] [--all-ranks]\n"
    "                    [--estimate [--hardware h100-sxm|h200|cpu-this-machine|FILE.toml]\n"
    "                     [--model-config config.json]] [key.path=value ...]";

// A JSON value as the TOML of an override's value.
std::string toml_value(const nlohmann::ordered_json& value) {
  return value.is_string() ? nlohmann::ordered_json(value.get<std::string>()).dump() : value.dump();
}

// A Hugging Face config.json as [model] overrides: model_type and the keys
// that model plugin reads; the others (the tokenizer's ids, dropout, the
// checkpoint's dtype, ...) are named on stderr, since no estimate uses them.
std::vector<std::string> model_config_overrides(const std::string& path,
                                                const PluginLoader& loader) {
  std::ifstream file(path);
  if (!file) throw Error(MESHRUN_NOT_FOUND, fmt::format("--model-config {}: cannot read", path));
  nlohmann::ordered_json json;
  try {
    json = nlohmann::ordered_json::parse(file);
  } catch (const nlohmann::json::exception& error) {
    throw invalid_argument(fmt::format("--model-config {}: not JSON: {}", path, error.what()));
  }
  if (!json.is_object() || !json.contains("model_type") || !json["model_type"].is_string()) {
    throw invalid_argument(
        fmt::format("--model-config {}: expected a config.json object with \"model_type\"", path));
  }
  const std::string model_type = json["model_type"].get<std::string>();
  const std::vector<std::string> keys =
      model_config_keys(*loader.load(PluginKind::model, model_type));
  std::vector<std::string> overrides = {"model.model_type=" + toml_value(json["model_type"])};
  std::vector<std::string> unused;
  for (const auto& [key, value] : json.items()) {
    if (key == "model_type") continue;
    if (std::find(keys.begin(), keys.end(), key) != keys.end() && !value.is_null()) {
      overrides.push_back("model." + key + "=" + toml_value(value));
    } else {
      unused.push_back(key);
    }
  }
  if (!unused.empty()) {
    std::fprintf(stderr, "meshrun plan: %s: keys the %s plugin does not read, not estimated: %s\n",
                 path.c_str(), model_type.c_str(),
                 fmt::format("{}", fmt::join(unused, ", ")).c_str());
  }
  return overrides;
}

}  // namespace

int run_plan(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(args,
                                         {{"world-size", true},
                                          {"json", false},
                                          {"all-ranks", false},
                                          {"estimate", false},
                                          {"hardware", true},
                                          {"nproc-per-node", true},
                                          {"model-config", true},
                                          {"help", false}},
                                         "plan");
    if (parsed.has_flag("help")) {
      std::puts(kPlanUsage);
      return 0;
    }
    if (parsed.positionals.size() != 1) {
      throw invalid_argument("meshrun plan: expected exactly one CONFIG.toml argument, got " +
                             std::to_string(parsed.positionals.size()));
    }
    const bool estimate = parsed.has_flag("estimate");
    for (const char* option : {"hardware", "model-config"}) {
      if (!estimate && parsed.value(option)) {
        throw invalid_argument(fmt::format("option '--{}' needs '--estimate'", option));
      }
    }
    const PluginLoader loader = PluginLoader::from_environment();
    std::vector<std::string> overrides;
    if (const auto model_config = parsed.value("model-config")) {
      overrides = model_config_overrides(*model_config, loader);
    }
    overrides.insert(overrides.end(), parsed.overrides.begin(), parsed.overrides.end());
    const Config config = load_config(parsed.positionals[0], overrides);
    const auto world_option = parsed.value("world-size");
    const int64_t world_size = world_option ? parse_int_option("world-size", *world_option, 1,
                                                               std::numeric_limits<int32_t>::max())
                                            : default_world_size(config);
    const Plan plan = make_plan(config, world_size, loader);
    const bool all_ranks = parsed.has_flag("all-ranks");
    const int64_t ranks_per_node =
        parsed.value("nproc-per-node")
            ? parse_int_option("nproc-per-node", *parsed.value("nproc-per-node"), 1, 4096)
            : 0;
    std::optional<Estimate> estimated;
    if (estimate) {
      const std::string hardware = parsed.value("hardware").value_or("cpu-this-machine");
      estimated = estimate_run(
          plan, hardware_profile(hardware, hardware == "cpu-this-machine" && ranks_per_node == 0
                                               ? world_size
                                               : ranks_per_node));
    }
    if (parsed.has_flag("json")) {
      nlohmann::ordered_json json = plan_to_json(plan, all_ranks, ranks_per_node);
      if (estimated) json["estimate"] = estimate_to_json(*estimated);
      std::puts(json.dump().c_str());
    } else {
      std::fputs(plan_to_text(plan, all_ranks, ranks_per_node).c_str(), stdout);
      if (estimated) std::fputs(estimate_to_text(*estimated).c_str(), stdout);
    }
    return 0;
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
