#include "plan/tp_plan.hpp"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <map>
#include <optional>

#include "errors.hpp"
#include "model/tensor_parallel.hpp"
#include "support/input_file.hpp"

namespace meshrun {
namespace {

using nlohmann::ordered_json;

constexpr const char* kKey = "distributed.tp_plan";
constexpr int64_t kMaxPlanFileBytes = int64_t(1) << 20;

[[noreturn]] void reject(const std::string& reason) {
  throw Error(MESHRUN_INVALID_ARGUMENT, fmt::format("{}: {}", kKey, reason), kKey);
}

// A style the plan file gives, and where.
struct GivenStyle {
  std::string pattern, style;
  int64_t line = 0;
};

// The model's modules (of its parameters), in description order, once each.
std::vector<std::string> model_modules(const ModelDescription& d) {
  std::vector<std::string> modules;
  for (const ModelParameter& p : d.parameters) {
    std::string module = module_of(p.name);
    if (modules.empty() || modules.back() != module) modules.push_back(std::move(module));
  }
  return modules;
}

std::vector<GivenStyle> read_plan_file(const std::string& path) {
  if (const auto problem = unreadable_input_file(path, kMaxPlanFileBytes)) reject(*problem);
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& error) {
    reject(fmt::format("{}:{}:{}: {}", path, error.source().begin.line, error.source().begin.column,
                       error.description()));
  }
  std::vector<GivenStyle> given;
  for (const auto& [key, node] : table) {
    const int64_t line = node.source().begin.line;
    const auto style = node.value<std::string>();
    if (!style || (*style != "colwise" && *style != "rowwise" && *style != "replicate")) {
      reject(
          fmt::format("{}:{}: \"{}\" must be \"colwise\", \"rowwise\" or \"replicate\" (quote "
                      "the module name: \"model.layers.*.mlp.up_proj\" = \"colwise\")",
                      path, line, key.str()));
    }
    given.push_back({std::string(key.str()), *style, line});
  }
  return given;
}

// The style each module gets from the file (none: not named, replicated).
std::map<std::string, const GivenStyle*> styles_of_modules(const std::vector<GivenStyle>& given,
                                                           const std::vector<std::string>& modules,
                                                           const std::string& path) {
  std::map<std::string, const GivenStyle*> styles;
  for (const GivenStyle& g : given) {
    bool matched = false;
    for (const std::string& module : modules) {
      if (!module_matches(g.pattern, module)) continue;
      matched = true;
      const GivenStyle*& style = styles[module];
      if (style != nullptr && style->style != g.style) {
        reject(fmt::format("{}:{}: \"{}\" gives {} '{}', but line {} gives it '{}'", path, g.line,
                           g.pattern, module, g.style, style->line, style->style));
      }
      style = &g;
    }
    if (!matched) {
      reject(
          fmt::format("{}:{}: \"{}\" names none of the model's modules (such as {} or {}; '*' "
                      "stands for one name component)",
                      path, g.line, g.pattern, modules.front(),
                      modules[std::min<size_t>(2, modules.size() - 1)]));
    }
  }
  return styles;
}

// The block each module is in, with its parallel style; none for modules
// the model computes replicated only.
struct BlockModule {
  size_t block;
  std::string style;
};
std::optional<BlockModule> block_of(const ModelDescription& d, const std::string& module) {
  for (size_t b = 0; b < d.tp_blocks.size(); ++b) {
    for (const auto& [pattern, style] : d.tp_blocks[b].modules) {
      if (module_matches(pattern, module)) return BlockModule{b, style};
    }
  }
  return std::nullopt;
}

// Each block parallel or not, as the file's styles say; refuses styles the
// model cannot compute and blocks given both ways.
std::vector<bool> blocks_from_file(const ModelDescription& d, const std::string& path) {
  const std::vector<std::string> modules = model_modules(d);
  const std::vector<GivenStyle> given = read_plan_file(path);
  const auto styles = styles_of_modules(given, modules, path);
  std::vector<std::optional<bool>> parallel(d.tp_blocks.size());
  std::vector<std::string> decided_by(d.tp_blocks.size());
  for (const std::string& module : modules) {
    const auto found = styles.find(module);
    const GivenStyle* g = found != styles.end() ? found->second : nullptr;
    const std::string style = g ? g->style : "replicate";
    const std::string at = g ? fmt::format("{}:{}: ", path, g->line) : "";
    const auto member = block_of(d, module);
    if (!member) {
      if (style != "replicate") {
        reject(
            fmt::format("{}{} is '{}', but the model computes it whole on every rank; valid: "
                        "'replicate'",
                        at, module, style));
      }
      continue;
    }
    if (style != "replicate" && style != member->style) {
      reject(
          fmt::format("{}{} is '{}', but the model computes it '{}'; valid: '{}' or "
                      "'replicate'",
                      at, module, style, member->style, member->style));
    }
    const bool is_parallel = style != "replicate";
    std::optional<bool>& block = parallel[member->block];
    if (block && *block != is_parallel) {
      reject(
          fmt::format("{}{} is '{}', but {} of the same block ('{}') is {}; the model "
                      "computes the block's modules over tp together or replicates them "
                      "together",
                      at, module, style, decided_by[member->block], d.tp_blocks[member->block].name,
                      *block ? "parallel"
                             : "'replicate' (a module the file does not name "
                               "is replicated)"));
    }
    block = is_parallel;
    if (decided_by[member->block].empty()) decided_by[member->block] = module;
  }
  std::vector<bool> result;
  for (const auto& block : parallel) result.push_back(block.value_or(false));
  return result;
}

// The blocks all of whose parameters are in layer units.
std::vector<bool> layer_blocks(const ModelDescription& d) {
  std::vector<bool> parallel(d.tp_blocks.size(), true);
  for (const ModelParameter& p : d.parameters) {
    const auto member = block_of(d, module_of(p.name));
    if (member && !d.is_layer_unit(p.unit)) parallel[member->block] = false;
  }
  return parallel;
}

std::vector<bool> chosen_blocks(const Config& config, const ModelDescription& d) {
  const std::string& plan = config.distributed.tp_plan;
  if (plan.empty() || plan == "default") return std::vector<bool>(d.tp_blocks.size(), true);
  if (d.tp_blocks.empty()) {
    reject(
        fmt::format("'{}': the model plugin describes no \"tp_blocks\", so it computes one "
                    "tensor-parallel layout only (docs/model.md); remove the key",
                    plan));
  }
  if (plan == "layers") return layer_blocks(d);
  if (plan.size() > 5 && plan.compare(plan.size() - 5, 5, ".toml") == 0) {
    return blocks_from_file(d, plan);
  }
  reject(
      fmt::format("'{}' is not a plan: valid are \"default\", \"layers\", or the path of a "
                  ".toml file giving a style per module",
                  plan));
}

}  // namespace

TensorParallelChoice choose_tensor_parallel(const Config& config, const ModelDescription& d) {
  const std::vector<bool> parallel = chosen_blocks(config, d);
  TensorParallelChoice choice;
  for (const ModelParameter& p : d.parameters) {
    const auto member = p.tp == "replicate" ? std::nullopt : block_of(d, module_of(p.name));
    choice.placements.push_back(member && !parallel[member->block] ? "replicate" : p.tp);
  }
  choice.rules = ordered_json::array();
  for (size_t b = 0; b < d.tp_blocks.size(); ++b) {
    for (const auto& [pattern, style] : d.tp_blocks[b].modules) {
      choice.rules.push_back({{"module", pattern}, {"style", parallel[b] ? style : "replicate"}});
    }
  }
  return choice;
}

}  // namespace meshrun
