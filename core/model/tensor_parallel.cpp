#include "model/tensor_parallel.hpp"

#include <fmt/format.h>

#include <fmt/ranges.h>
#include <algorithm>

#include <regex>

#include "errors.hpp"

namespace meshrun {
namespace {

using nlohmann::ordered_json;

[[noreturn]] void refuse_tp_size(const std::string& what) {
  throw Error(MESHRUN_INVALID_ARGUMENT, "distributed.tp_size: " + what, "distributed.tp_size");
}

TensorPlacement parse_placement(const ordered_json& entry, const ModelParameter& parameter) {
  const std::string text = entry.value("tp", std::string("replicate"));
  const auto placement = parse_tensor_placement(text, parameter.shape.size());
  if (!placement) {
    refuse_tp_size(
        fmt::format("the plan places parameter '{}' (shape [{}]) as '{}'; valid placements "
                    "are \"replicate\", \"shard(d)\" and \"shard(d,blocks)\" with d a "
                    "dimension of the parameter",
                    parameter.name, fmt::join(parameter.shape, ", "), text));
  }
  return *placement;
}

}  // namespace

std::optional<TensorPlacement> parse_tensor_placement(const std::string& text, size_t ndim) {
  if (text == "replicate") return TensorPlacement{};
  static const std::regex shard(R"(shard\((\d)(?:,(\d{1,6}))?\))");
  std::smatch match;
  if (!std::regex_match(text, match, shard)) return std::nullopt;
  TensorPlacement placement{std::stoi(match[1].str()),
                            match[2].matched ? std::stoll(match[2].str()) : 1};
  if (size_t(placement.dim) >= ndim || placement.blocks < 1) return std::nullopt;
  return placement;
}

std::string module_of(const std::string& parameter) {
  const size_t dot = parameter.rfind('.');
  return dot == std::string::npos ? parameter : parameter.substr(0, dot);
}

bool module_matches(const std::string& pattern, const std::string& module) {
  size_t p = 0, m = 0;
  while (p < pattern.size() && m <= module.size()) {
    if (pattern[p] == '*') {
      const size_t end = module.find('.', m);
      const size_t stop = end == std::string::npos ? module.size() : end;
      if (stop == m) return false;
      m = stop;
      ++p;
    } else if (m < module.size() && pattern[p] == module[m]) {
      ++p;
      ++m;
    } else {
      return false;
    }
  }
  return p == pattern.size() && m == module.size();
}

TensorParallelLayout::TensorParallelLayout(const ModelDescription& full, const ordered_json& plan,
                                           int64_t tp)
    : tp_(tp), placements_(full.parameters.size()), full_(full.parameters), local_(full) {
  if (tp == 1) return;
  for (const auto& entry : plan.at("parameters")) {
    const int64_t index = full.parameter_index(entry.at("name").get<std::string>());
    placements_[size_t(index)] = parse_placement(entry, full.parameters[size_t(index)]);
  }
  int64_t offset = 0;
  for (size_t p = 0; p < full.parameters.size(); ++p) {
    ModelParameter& parameter = local_.parameters[p];
    const TensorPlacement& placement = placements_[p];
    if (placement.sharded()) {
      int64_t& extent = parameter.shape[size_t(placement.dim)];
      if (extent % (tp * placement.blocks) != 0) {
        refuse_tp_size(fmt::format(
            "{} does not divide dimension {} of parameter '{}' ({} elements{}), "
            "which the plan shards over tp; choose a tp_size that divides it, or a "
            "distributed.tp_plan that replicates it",
            tp, placement.dim, parameter.name, extent,
            placement.blocks > 1
                ? fmt::format(" in {} blocks of {}", placement.blocks, extent / placement.blocks)
                : std::string()));
      }
      extent /= tp;
      parameter.numel /= tp;
    }
    parameter.offset = offset;
    offset += parameter.numel;
  }
  local_.numel = offset;
}

bool TensorParallelLayout::any_sharded() const {
  return std::any_of(placements_.begin(), placements_.end(),
                     [](const TensorPlacement& p) { return p.sharded(); });
}

TensorParallelLayout::Split TensorParallelLayout::split(int64_t parameter) const {
  const TensorPlacement& placement = placements_[size_t(parameter)];
  const std::vector<int64_t>& shape = local_.parameters[size_t(parameter)].shape;
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < placement.dim; ++d) outer *= shape[size_t(d)];
  for (size_t d = size_t(placement.dim) + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t piece = shape[size_t(placement.dim)] / placement.blocks;
  return {outer, placement.blocks, piece * inner};
}

// Local element l is (o, b, j) of [outer, blocks, run]; in the full tensor
// [outer, blocks, tp, run] it is (o, b, rank, j).
void TensorParallelLayout::for_each_run(
    int64_t parameter, int64_t rank, int64_t begin, int64_t count,
    const std::function<void(int64_t, int64_t, int64_t)>& run) const {
  if (!placements_[size_t(parameter)].sharded()) {
    if (count > 0) run(begin, begin, count);
    return;
  }
  const Split s = split(parameter);
  for (int64_t l = begin, end = begin + count; l < end;) {
    const int64_t row = l / s.run, j = l % s.run;
    const int64_t n = std::min(s.run - j, end - l);
    run(l, (row * tp_ + rank) * s.run + j, n);
    l += n;
  }
}

void TensorParallelLayout::slice(int64_t parameter, int64_t rank, const float* full,
                                 float* local) const {
  for_each_run(parameter, rank, 0, local_.parameters[size_t(parameter)].numel,
               [&](int64_t l, int64_t f, int64_t n) { std::copy_n(full + f, n, local + l); });
}

void TensorParallelLayout::assemble(int64_t parameter, const float* pieces, float* full) const {
  const int64_t numel = local_.parameters[size_t(parameter)].numel;
  const int64_t ranks = placements_[size_t(parameter)].sharded() ? tp_ : 1;
  for (int64_t r = 0; r < ranks; ++r) {
    for_each_run(parameter, r, 0, numel, [&](int64_t l, int64_t f, int64_t n) {
      std::copy_n(pieces + r * numel + l, n, full + f);
    });
  }
}

}  // namespace meshrun
