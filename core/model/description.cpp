// Reading a model plugin's description (meshrun/model.h): every field
// checked, so that what the core plans and trains with holds together.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include "errors.hpp"
#include "model/model.hpp"
#include "model/tensor_parallel.hpp"

namespace meshrun {
namespace {

using nlohmann::ordered_json;

[[noreturn]] void bad_description(const std::string& origin, const std::string& what) {
  throw Error(MESHRUN_INVALID_ARGUMENT,
              fmt::format("model.model_type: model plugin {}: describe: {}", origin, what),
              "model.model_type");
}

const ordered_json& field(const ordered_json& object, const char* name, const std::string& where,
                          const std::string& origin) {
  if (!object.is_object() || !object.contains(name)) {
    bad_description(origin, fmt::format("{} has no \"{}\"", where, name));
  }
  return object.at(name);
}

std::string text_field(const ordered_json& object, const char* name, const std::string& where,
                       const std::string& origin) {
  const ordered_json& value = field(object, name, where, origin);
  if (!value.is_string() || value.get<std::string>().empty()) {
    bad_description(origin, fmt::format("{}.{} must be a non-empty string", where, name));
  }
  return value.get<std::string>();
}

const ordered_json& array_field(const ordered_json& object, const char* name,
                                const std::string& origin) {
  const ordered_json& value = field(object, name, "the description", origin);
  if (!value.is_array() || value.empty()) {
    bad_description(origin, fmt::format("\"{}\" must be a non-empty array", name));
  }
  return value;
}

std::vector<int64_t> shape_of(const ordered_json& parameter, const std::string& where,
                              const std::string& origin) {
  const ordered_json& shape = field(parameter, "shape", where, origin);
  bool valid = shape.is_array() && !shape.empty();
  std::vector<int64_t> dims;
  for (size_t d = 0; valid && d < shape.size(); ++d) {
    valid = shape[d].is_number_integer() && shape[d].get<int64_t>() > 0;
    if (valid) dims.push_back(shape[d].get<int64_t>());
  }
  if (!valid) {
    bad_description(origin, where + ".shape must be a non-empty array of positive integers");
  }
  return dims;
}

// The most float32 parameters a model may have: 2^47 bytes (128 TiB) is the
// whole user address space of an x86-64 or AArch64 process. Below it no sum
// or product of sizes the core forms (numel, offsets, bytes) can overflow.
constexpr int64_t kFloatBytes = 4;
constexpr int64_t kMaxParameterElements = (int64_t{1} << 47) / kFloatBytes;

[[noreturn]] void refuse_unaddressable(const std::string& origin, const std::string& what,
                                       double elements) {
  bad_description(origin, fmt::format("{} take {:.4g} bytes as float32, more than the 2^47 bytes "
                                      "(128 TiB) any machine can address",
                                      what, elements * kFloatBytes));
}

// The product of the extents, refused past kMaxParameterElements.
int64_t numel_of(const ModelParameter& parameter, const std::string& where,
                 const std::string& origin) {
  int64_t numel = 1;
  double exact = 1;  // may be past int64_t, for the message
  for (const int64_t extent : parameter.shape) {
    exact *= double(extent);
    if (__builtin_mul_overflow(numel, extent, &numel)) numel = kMaxParameterElements + 1;
    numel = std::min(numel, kMaxParameterElements + 1);
  }
  if (numel > kMaxParameterElements) {
    refuse_unaddressable(origin, fmt::format("{} ('{}')", where, parameter.name), exact);
  }
  return numel;
}

// Unit name -> index into ModelDescription::units.
using UnitIndices = std::unordered_map<std::string, int32_t>;

UnitIndices read_units(const ordered_json& json, const std::string& origin, ModelDescription& d) {
  UnitIndices indices;
  for (const auto& unit : array_field(json, "units", origin)) {
    if (!unit.is_string() ||
        !indices.emplace(unit.get<std::string>(), int32_t(d.units.size())).second) {
      bad_description(origin, "\"units\" must hold distinct unit names");
    }
    d.units.push_back(unit.get<std::string>());
  }
  if (d.units.back() != "root") {
    bad_description(origin, "the last unit must be \"root\" (it encloses the others), not '" +
                                d.units.back() + "'");
  }
  return indices;
}

// "unit_kinds" (ABI 1.11): one per unit, the root last and only there, at
// most one embedding and one head. Absent: every unit but the root is a
// layer.
void read_unit_kinds(const ordered_json& json, const std::string& origin, ModelDescription& d) {
  d.unit_kinds.assign(d.units.size(), UnitKind::layer);
  d.unit_kinds.back() = UnitKind::root;
  if (!json.contains("unit_kinds")) return;
  const ordered_json& kinds = json.at("unit_kinds");
  if (!kinds.is_array() || kinds.size() != d.units.size()) {
    bad_description(origin, fmt::format("\"unit_kinds\" must be an array of {} kinds, one per "
                                        "unit in \"units\"",
                                        d.units.size()));
  }
  const std::map<std::string, UnitKind> named = {{"layer", UnitKind::layer},
                                                 {"embedding", UnitKind::embedding},
                                                 {"head", UnitKind::head},
                                                 {"root", UnitKind::root}};
  int embeddings = 0, heads = 0;
  for (size_t u = 0; u < kinds.size(); ++u) {
    const auto found = kinds[u].is_string() ? named.find(kinds[u].get<std::string>()) : named.end();
    const bool last = u + 1 == kinds.size();
    if (found == named.end() || (found->second == UnitKind::root) != last) {
      bad_description(origin, fmt::format("unit_kinds[{}] ({}) must be {}", u, kinds[u].dump(),
                                          last ? "\"root\" (the last unit's kind)"
                                               : "\"layer\", \"embedding\" or \"head\""));
    }
    d.unit_kinds[u] = found->second;
    embeddings += found->second == UnitKind::embedding ? 1 : 0;
    heads += found->second == UnitKind::head ? 1 : 0;
  }
  if (embeddings > 1 || heads > 1) {
    bad_description(origin, "\"unit_kinds\" may name one \"embedding\" and one \"head\" unit");
  }
}

void read_parameters(const ordered_json& json, const std::string& origin, const UnitIndices& units,
                     ModelDescription& d) {
  for (const auto& entry : array_field(json, "parameters", origin)) {
    const std::string where = fmt::format("parameters[{}]", d.parameters.size());
    ModelParameter parameter;
    parameter.name = text_field(entry, "name", where, origin);
    parameter.shape = shape_of(entry, where, origin);
    parameter.numel = numel_of(parameter, where, origin);
    const std::string unit = text_field(entry, "unit", where, origin);
    const auto found = units.find(unit);
    if (found == units.end()) {
      bad_description(origin,
                      fmt::format("{} ('{}') is in unit '{}', which \"units\" does not list", where,
                                  parameter.name, unit));
    }
    if (!d.parameter_indices.emplace(parameter.name, int64_t(d.parameters.size())).second) {
      bad_description(origin, fmt::format("parameter '{}' is listed twice", parameter.name));
    }
    parameter.unit = found->second;
    if (entry.contains("tp")) {
      parameter.tp = text_field(entry, "tp", where, origin);
      if (!parse_tensor_placement(parameter.tp, parameter.shape.size())) {
        bad_description(origin, fmt::format("{}.tp ('{}') must be \"replicate\", \"shard(d)\" or "
                                            "\"shard(d,blocks)\" with d < {}",
                                            where, parameter.tp, parameter.shape.size()));
      }
    }
    if (entry.contains("expert")) {
      if (!entry.at("expert").is_number_integer() || entry.at("expert").get<int64_t>() < 0) {
        bad_description(origin, fmt::format("{}.expert must be an integer >= 0", where));
      }
      parameter.expert = entry.at("expert").get<int64_t>();
    }
    parameter.offset = d.numel;
    d.numel += parameter.numel;
    if (d.numel > kMaxParameterElements) refuse_unaddressable(origin, "the parameters", d.numel);
    d.parameters.push_back(std::move(parameter));
  }
}

void read_modules(const ordered_json& json, const std::string& origin, ModelDescription& d) {
  std::vector<bool> used(d.parameters.size(), false);
  for (const auto& entry : array_field(json, "modules", origin)) {
    const std::string where = fmt::format("modules[{}]", d.modules.size());
    ModelModule module;
    module.name = text_field(entry, "name", where, origin);
    if (!d.module_indices.emplace(module.name, int64_t(d.modules.size())).second) {
      bad_description(origin, fmt::format("module '{}' is listed twice", module.name));
    }
    const ordered_json& names = field(entry, "parameters", where, origin);
    if (!names.is_array()) bad_description(origin, where + ".parameters must be an array");
    for (const auto& name : names) {
      const int64_t index = name.is_string() ? d.parameter_index(name.get<std::string>()) : -1;
      if (index < 0) {
        bad_description(origin, fmt::format("module '{}' uses {}, which is not a parameter",
                                            module.name, name.dump()));
      }
      module.parameters.push_back(index);
      used[size_t(index)] = true;
    }
    if (entry.contains("group") && entry.at("group").is_string()) {
      module.group = entry.at("group").get<std::string>();
    }
    d.modules.push_back(std::move(module));
  }
  for (size_t p = 0; p < used.size(); ++p) {
    if (!used[p]) {
      bad_description(origin,
                      fmt::format("parameter '{}' is used by no module", d.parameters[p].name));
    }
  }
}

// "gemms" (1.11): [{"k", "n", "count", "rows"?, "tp"?}], positive sizes
// and counts, rows in (0, 1], tp "k" or "n"; together exactly the
// matmul_parameters a token meets (k x n x count x rows summed, to 1e-6).
std::vector<ModelDescription::Gemm> parse_gemms(const ordered_json& gemms, int64_t matmul,
                                                const std::string& origin) {
  const auto refuse = [&](size_t i) {
    bad_description(origin,
                    fmt::format("flops.gemms[{}] must be {{\"k\": k, \"n\": n, \"count\": c, "
                                "\"rows\"?: r, \"tp\"?: \"k\" or \"n\"}}, positive integers k, n, "
                                "c and 0 < r <= 1",
                                i));
  };
  if (!gemms.is_array()) refuse(0);
  std::vector<ModelDescription::Gemm> parsed;
  double weights = 0;
  for (size_t i = 0; i < gemms.size(); ++i) {
    const ordered_json& g = gemms[i];
    const auto positive = [&](const char* key) {
      if (!g.is_object() || !g.contains(key) || !g.at(key).is_number_integer() ||
          g.at(key).get<int64_t>() <= 0) {
        refuse(i);
      }
      return g.at(key).get<int64_t>();
    };
    ModelDescription::Gemm gemm{positive("k"), positive("n"), positive("count"), 1.0, ""};
    if (g.contains("rows")) {
      if (!g.at("rows").is_number()) refuse(i);
      gemm.rows = g.at("rows").get<double>();
      if (!(gemm.rows > 0 && gemm.rows <= 1)) refuse(i);
    }
    if (g.contains("tp")) {
      gemm.tp = g.at("tp").is_string() ? g.at("tp").get<std::string>() : "";
      if (gemm.tp != "k" && gemm.tp != "n") refuse(i);
    }
    weights += double(gemm.k) * double(gemm.n) * double(gemm.count) * gemm.rows;
    parsed.push_back(gemm);
  }
  if (std::abs(weights - double(matmul)) > 1e-6 * double(std::max<int64_t>(matmul, 1))) {
    bad_description(origin, fmt::format("flops.gemms hold {:.0f} weights a token meets, but "
                                        "flops.matmul_parameters says {}: they must agree",
                                        weights, matmul));
  }
  return parsed;
}

// "flops": {"matmul_parameters": n, "attention": {"layers": l, "width": w},
// "gemms"?: [...]}, non-negative integers.
ModelDescription::Flops parse_flops(const ordered_json& flops, const std::string& origin) {
  const auto count = [](const ordered_json& object, const char* key) -> std::optional<int64_t> {
    if (!object.is_object() || !object.contains(key) || !object.at(key).is_number_integer() ||
        object.at(key).get<int64_t>() < 0) {
      return std::nullopt;
    }
    return object.at(key).get<int64_t>();
  };
  const ordered_json attention =
      flops.is_object() ? flops.value("attention", ordered_json()) : ordered_json();
  const auto matmul = count(flops, "matmul_parameters");
  const auto layers = count(attention, "layers"), width = count(attention, "width");
  if (!matmul || !layers || !width) {
    bad_description(origin,
                    "\"flops\" must be {\"matmul_parameters\": n, \"attention\": {\"layers\": l, "
                    "\"width\": w}}, non-negative integers");
  }
  ModelDescription::Flops parsed{*matmul, *layers, *width, {}};
  if (flops.contains("gemms")) parsed.gemms = parse_gemms(flops.at("gemms"), *matmul, origin);
  return parsed;
}

// "activations": {"layer": {"whole": a, "tp_split": b}, "elementwise": {...},
// "stream": n, "head": {...}, "float32"?: {"layer", "elementwise", "head"}},
// non-negative integers, each float32 part at most its whole.
ModelDescription::Activations parse_activations(const ordered_json& activations,
                                                const std::string& origin) {
  const auto refuse = [&] {
    bad_description(origin,
                    "\"activations\" must be {\"layer\": {\"whole\": a, \"tp_split\": b}, "
                    "\"elementwise\": {...}, \"stream\": n, \"head\": {...}, \"float32\": "
                    "{\"layer\", \"elementwise\", \"head\"} (optional)}, non-negative integers, "
                    "each float32 part at most its whole");
  };
  const auto count = [&](const ordered_json& object, const char* key) {
    if (!object.is_object() || !object.contains(key) || !object.at(key).is_number_integer() ||
        object.at(key).get<int64_t>() < 0) {
      refuse();
    }
    return object.at(key).get<int64_t>();
  };
  const auto per_token = [&](const ordered_json& parts, const char* key) {
    const ordered_json part = parts.is_object() ? parts.value(key, ordered_json()) : ordered_json();
    return ModelDescription::PerToken{count(part, "whole"), count(part, "tp_split")};
  };
  ModelDescription::Activations a{
      per_token(activations, "layer"), per_token(activations, "elementwise"),
      count(activations, "stream"), per_token(activations, "head"), std::nullopt};
  if (!activations.contains("float32")) return a;
  const ordered_json& float32 = activations.at("float32");
  a.float32 = {per_token(float32, "layer"), per_token(float32, "elementwise"),
               per_token(float32, "head")};
  const auto within = [](const ModelDescription::PerToken& part,
                         const ModelDescription::PerToken& whole) {
    return part.whole <= whole.whole && part.tp_split <= whole.tp_split;
  };
  if (!within(a.float32->layer, a.layer) || !within(a.float32->elementwise, a.elementwise) ||
      !within(a.float32->head, a.head)) {
    refuse();
  }
  return a;
}

void read_limits(const ordered_json& json, const std::string& origin, ModelDescription& d) {
  const ordered_json& vocab = field(json, "vocab_size", "the description", origin);
  if (!vocab.is_number_integer() || vocab.get<int64_t>() <= 0) {
    bad_description(origin, "\"vocab_size\" must be a positive integer");
  }
  d.vocab_size = vocab.get<int64_t>();
  if (json.contains("max_seq_len") && !json.at("max_seq_len").is_null()) {
    const ordered_json& limit = json.at("max_seq_len");
    if (!limit.is_number_integer() || limit.get<int64_t>() <= 0) {
      bad_description(origin, "\"max_seq_len\" must be a positive integer or null");
    }
    d.max_seq_len = limit.get<int64_t>();
  }
  if (json.contains("sequence_parallel")) {
    if (!json.at("sequence_parallel").is_boolean()) {
      bad_description(origin, "\"sequence_parallel\" must be true or false");
    }
    d.sequence_parallel = json.at("sequence_parallel").get<bool>();
  }
  if (json.contains("devices")) {
    const ordered_json& devices = json.at("devices");
    const auto known = [](const ordered_json& device) {
      return device == "cpu" || device == "cuda";
    };
    if (!devices.is_array() || devices.empty() ||
        !std::all_of(devices.begin(), devices.end(), known)) {
      bad_description(origin, "\"devices\" must be a non-empty array of \"cpu\" and \"cuda\"");
    }
    d.devices = devices.get<std::vector<std::string>>();
  }
  if (json.contains("tensor_parallel")) {
    if (!json.at("tensor_parallel").is_boolean()) {
      bad_description(origin, "\"tensor_parallel\" must be true or false");
    }
    d.tensor_parallel = json.at("tensor_parallel").get<bool>();
  }
  if (json.contains("autocast_dtypes")) {
    const ordered_json& dtypes = json.at("autocast_dtypes");
    const auto is_string = [](const ordered_json& dtype) { return dtype.is_string(); };
    if (!dtypes.is_array() || !std::all_of(dtypes.begin(), dtypes.end(), is_string)) {
      bad_description(origin, "\"autocast_dtypes\" must be an array of dtype names");
    }
    d.autocast_dtypes = dtypes.get<std::vector<std::string>>();
  }
  if (json.contains("unit_class")) {
    if (!json.at("unit_class").is_string()) {
      bad_description(origin, "\"unit_class\" must be a class name");
    }
    d.unit_class = json.at("unit_class").get<std::string>();
  }
  if (json.contains("context_parallel")) {
    const ordered_json& cp = json.at("context_parallel");
    const auto positive = [&](const char* key) {
      return cp.is_object() && cp.contains(key) && cp.at(key).is_number_integer() &&
             cp.at(key).get<int64_t>() > 0;
    };
    if (!positive("heads") || !positive("kv_heads")) {
      bad_description(origin,
                      "\"context_parallel\" must be {\"heads\": n, \"kv_heads\": m}, "
                      "positive integers");
    }
    d.context_parallel = ModelDescription::AttentionHeads{cp.at("heads").get<int64_t>(),
                                                          cp.at("kv_heads").get<int64_t>()};
  }
  if (json.contains("experts")) {
    const ordered_json& experts = json.at("experts");
    const auto positive = [&](const char* key) {
      return experts.is_object() && experts.contains(key) && experts.at(key).is_number_integer() &&
             experts.at(key).get<int64_t>() > 0;
    };
    if (!positive("count") || !positive("top_k")) {
      bad_description(origin,
                      "\"experts\" must be {\"count\": n, \"top_k\": k}, positive integers");
    }
    d.experts = ModelDescription::Experts{experts.at("count").get<int64_t>(),
                                          experts.at("top_k").get<int64_t>()};
    for (const ModelParameter& parameter : d.parameters) {
      if (parameter.expert >= d.experts->count) {
        bad_description(origin,
                        fmt::format("parameter '{}' is of expert {}, past \"experts\".count {}",
                                    parameter.name, parameter.expert, d.experts->count));
      }
    }
  }
  if (json.contains("flops")) d.flops = parse_flops(json.at("flops"), origin);
  if (json.contains("activations")) {
    d.activations = parse_activations(json.at("activations"), origin);
  }
  if (json.contains("num_layers_key") && json.at("num_layers_key").is_string()) {
    d.num_layers_key = "model." + json.at("num_layers_key").get<std::string>();
  }
  d.config = field(json, "config", "the description", origin);
  if (!d.config.is_object()) bad_description(origin, "\"config\" must be a JSON object");
}

std::pair<std::string, std::string> block_module(const std::string& pattern,
                                                 const ordered_json& style,
                                                 const std::string& where,
                                                 const std::string& origin) {
  if (!style.is_string() || (style != "colwise" && style != "rowwise")) {
    bad_description(origin, fmt::format("{}.modules[\"{}\"] must be \"colwise\" or \"rowwise\"",
                                        where, pattern));
  }
  return {pattern, style.get<std::string>()};
}

// "tp_blocks": every sharded parameter in a module of exactly one block, and
// every block's module pattern naming some parameter's module.
void read_tp_blocks(const ordered_json& json, const std::string& origin, ModelDescription& d) {
  if (!json.contains("tp_blocks")) return;
  const ordered_json& blocks = json.at("tp_blocks");
  if (!blocks.is_array()) bad_description(origin, "\"tp_blocks\" must be an array");
  for (const auto& entry : blocks) {
    const std::string where = fmt::format("tp_blocks[{}]", d.tp_blocks.size());
    TensorParallelBlock block{text_field(entry, "name", where, origin), {}};
    const ordered_json& modules = field(entry, "modules", where, origin);
    if (!modules.is_object() || modules.empty()) {
      bad_description(origin, where + ".modules must be a non-empty object");
    }
    for (const auto& [pattern, style] : modules.items()) {
      block.modules.push_back(block_module(pattern, style, where, origin));
    }
    d.tp_blocks.push_back(std::move(block));
  }
  for (const ModelParameter& p : d.parameters) {
    const std::string module = module_of(p.name);
    int blocks_of_p = 0;
    for (const TensorParallelBlock& block : d.tp_blocks) {
      bool in = false;
      for (const auto& [pattern, style] : block.modules) in = in || module_matches(pattern, module);
      blocks_of_p += in ? 1 : 0;
    }
    if (blocks_of_p > 1 || (blocks_of_p == 0 && p.tp != "replicate")) {
      bad_description(origin, fmt::format("tp_blocks: parameter '{}' ('{}') is in {} blocks; a "
                                          "parameter the model shards is in exactly one",
                                          p.name, p.tp, blocks_of_p));
    }
  }
  for (const TensorParallelBlock& block : d.tp_blocks) {
    for (const auto& module : block.modules) {
      const std::string& pattern = module.first;
      const bool names_some = std::any_of(
          d.parameters.begin(), d.parameters.end(),
          [&](const ModelParameter& p) { return module_matches(pattern, module_of(p.name)); });
      if (!names_some) {
        bad_description(origin, fmt::format("tp_blocks: block '{}' names module '{}', which no "
                                            "parameter belongs to",
                                            block.name, pattern));
      }
    }
  }
}

}  // namespace

int64_t ModelDescription::parameter_index(const std::string& name) const {
  const auto found = parameter_indices.find(name);
  return found == parameter_indices.end() ? -1 : found->second;
}

std::vector<int32_t> ModelDescription::forward_units() const {
  std::vector<int32_t> order;
  for (const UnitKind kind : {UnitKind::embedding, UnitKind::layer, UnitKind::head}) {
    for (int32_t u = 0; u < root_unit(); ++u) {
      if (unit_kinds[size_t(u)] == kind) order.push_back(u);
    }
  }
  return order;
}

int64_t ModelDescription::module_index(const std::string& name) const {
  const auto found = module_indices.find(name);
  return found == module_indices.end() ? -1 : found->second;
}

ModelDescription parse_description(const std::string& text, const std::string& origin) {
  ModelDescription d;
  try {
    d.json = ordered_json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    bad_description(origin, fmt::format("not JSON: {}", error.what()));
  }
  if (!d.json.is_object()) bad_description(origin, "the description is not a JSON object");
  const UnitIndices units = read_units(d.json, origin, d);
  read_unit_kinds(d.json, origin, d);
  read_parameters(d.json, origin, units, d);
  read_modules(d.json, origin, d);
  read_limits(d.json, origin, d);
  read_tp_blocks(d.json, origin, d);
  return d;
}

double flops_per_token(const ModelDescription& description, int64_t seq_len) {
  if (!description.flops) return 6.0 * double(description.numel);
  const ModelDescription::Flops& f = *description.flops;
  return 6.0 * double(f.matmul_parameters) +
         12.0 * double(f.attention_layers) * double(f.attention_width) * double(seq_len);
}

}  // namespace meshrun
