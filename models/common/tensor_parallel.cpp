#include "common/tensor_parallel.hpp"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include <string>
#include <vector>

#include "common/buffer.hpp"
#include "common/layers.hpp"
#include "common/stage.hpp"

namespace meshrun::models {

VocabShard vocab_shard(int64_t vocab, const TensorParallelGroup& tp) {
  const int64_t size = vocab / tp.size();
  return {tp.rank() * size, size};
}

VocabShard vocab_shard(int64_t vocab, const TensorParallelGroup& tp, const ParallelBlocks& blocks,
                       Block block) {
  return blocks[block] ? vocab_shard(vocab, tp) : VocabShard{0, vocab};
}

void ReplicatedOver::reduce_scatter_sum(const float* send, float* recv, int64_t count) {
  compute_.copy(recv, send + rank() * count, count);
}

void require_divisible(std::initializer_list<SplitExtent> extents, int64_t tp) {
  for (const SplitExtent& extent : extents) {
    if (!extent.split || extent.value % tp == 0) continue;
    throw std::invalid_argument(std::string("model.") + extent.key + ": " +
                                std::to_string(extent.value) +
                                " is not divisible by distributed.tp_size = " + std::to_string(tp) +
                                ", over which tensor parallelism splits it");
  }
}

const char* block_name(Block block) {
  switch (block) {
    case Block::attention:
      return "attention";
    case Block::mlp:
      return "mlp";
    case Block::embedding:
      return "embedding";
    case Block::head:
      return "lm_head";
  }
  return "?";
}

const ParallelModule* ParallelModules::find(const std::string& parameter) const {
  const std::string module = parameter.substr(0, parameter.rfind('.'));
  const std::string prefix = layer_prefix;
  if (module.rfind(prefix, 0) == 0) {
    const std::string in_layer = module.substr(module.find('.', prefix.size()) + 1);
    for (const ParallelModule& m : layer) {
      if (in_layer == m.name) return &m;
    }
    return nullptr;
  }
  for (const ParallelModule& m : root) {
    if (module == m.name) return &m;
  }
  return nullptr;
}

std::string ParallelModules::placement(const std::string& parameter) const {
  const ParallelModule* module = find(parameter);
  if (module == nullptr) return "replicate";
  const bool bias =
      parameter.size() >= 5 && parameter.compare(parameter.size() - 5, 5, ".bias") == 0;
  return bias ? module->bias : module->weight;
}

std::optional<Block> ParallelModules::block(const std::string& parameter) const {
  const ParallelModule* module = find(parameter);
  return module ? std::optional<Block>(module->block) : std::nullopt;
}

std::vector<BlockSpec> ParallelModules::specs(bool tied_lm_head) const {
  std::vector<BlockSpec> specs;
  const auto add = [&](const ParallelModule& m, const std::string& prefix) {
    if (tied_lm_head && m.block == Block::head) return;
    if (specs.empty() || specs.back().block != m.block) specs.push_back({m.block, {}});
    specs.back().modules.emplace_back(prefix + m.name, m.style);
  };
  add(root.front(), "");
  for (const ParallelModule& m : layer) add(m, std::string(layer_prefix) + "*.");
  for (size_t m = 1; m < root.size(); ++m) add(root[m], "");
  return specs;
}

void SingleRank::all_gather(const float* send, float* recv, int64_t count) {
  compute_.copy(recv, send, count);
}

void SingleRank::reduce_scatter_sum(const float* send, float* recv, int64_t count) {
  compute_.copy(recv, send, count);
}

void gather_rows(TensorParallelGroup& tp, const float* local, float* full, int64_t rows,
                 int64_t dim) {
  tp.all_gather(local, full, rows * dim);
}

void reduce_scatter_rows(TensorParallelGroup& tp, const float* partial, float* local, int64_t rows,
                         int64_t dim) {
  tp.reduce_scatter_sum(partial, local, rows * dim);
}

void vocab_parallel_embedding_forward(float* out, const int32_t* tokens, const float* table,
                                      int64_t rows, int64_t dim, const VocabShard& shard,
                                      TensorParallelGroup& tp, Compute& compute) {
  compute.embedding_forward(out, tokens, table, rows, dim, shard.begin, shard.size);
  if (tp.size() > 1) tp.all_reduce_sum(out, rows * dim);
}

void embedding_into_stream(float* out, float* scratch, const int32_t* tokens, const float* table,
                           int64_t rows, int64_t dim, const VocabShard& shard,
                           TensorParallelGroup& tp, bool sequence_parallel, Compute& compute) {
  if (!sequence_parallel) {
    vocab_parallel_embedding_forward(out, tokens, table, rows, dim, shard, tp, compute);
    return;
  }
  compute.embedding_forward(scratch, tokens, table, rows, dim, shard.begin, shard.size);
  reduce_scatter_rows(tp, scratch, out, rows / tp.size(), dim);
}

void vocab_parallel_embedding_backward(float* d_table, const int32_t* tokens, const float* d_out,
                                       int64_t rows, int64_t dim, const VocabShard& shard,
                                       Compute& compute) {
  compute.embedding_backward(d_table, tokens, d_out, rows, dim, shard.begin, shard.size);
}

double vocab_parallel_cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                                            const VocabShard& shard, TensorParallelGroup& tp,
                                            Compute& compute) {
  if (tp.size() == 1) return compute.cross_entropy_forward(logits, targets, rows, shard.size);
  Buffer<float> row_max(size_t(rows), compute), sums(size_t(2 * rows), compute);
  compute.vocab_parallel_row_max(row_max.data(), logits, rows, shard.size);
  tp.all_reduce_max(row_max.data(), rows);
  compute.vocab_parallel_exponentials(logits, sums.data(), row_max.data(), targets, rows,
                                      shard.begin, shard.size);
  tp.all_reduce_sum(sums.data(), 2 * rows);
  return compute.vocab_parallel_probabilities(logits, sums.data(), row_max.data(), rows,
                                              shard.size);
}

void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                           const VocabShard& shard, float scale, Compute& compute) {
  compute.vocab_parallel_cross_entropy_backward(probs, targets, rows, shard.begin, shard.size,
                                                scale);
}

Placements plan_placements(const char* plan_json) {
  Placements placements;
  const auto plan = nlohmann::json::parse(plan_json != nullptr ? plan_json : "{}");
  placements.sequence_parallel = plan.value("sequence_parallel", false);
  placements.async = plan.value("async_tensor_parallel", false);
  if (!plan.contains("parameters")) return placements;
  for (const auto& parameter : plan.at("parameters")) {
    placements.of[parameter.at("name").get<std::string>()] =
        parameter.value("tp", std::string("replicate"));
  }
  return placements;
}

namespace {

// Records that `view`'s block is planned parallel or not, as the block's
// views planned before it were.
void settle(ParallelBlocks& blocks, std::array<const ParameterView*, 4>& decided, Block block,
            const ParameterView& view, const std::string& planned, const char* family) {
  const bool parallel = planned != "replicate";
  const ParameterView*& first = decided[size_t(block)];
  require(first == nullptr || blocks[block] == parallel, family,
          "tensor parallelism: the plan places " + view.name + " as '" + planned + "' but " +
              (first ? first->name : "") + " of the same block (" + block_name(block) +
              ") otherwise; the model computes a block over tp or replicated as a whole");
  first = first ? first : &view;
  blocks.set(block, parallel);
}

}  // namespace

ParallelBlocks planned_blocks(const std::vector<ParameterView>& views, const Placements& placements,
                              const BlockOf& block_of, const char* family) {
  ParallelBlocks blocks;
  std::array<const ParameterView*, 4> decided{};
  for (const ParameterView& view : views) {
    const auto found = placements.of.find(view.name);
    const std::string planned = found != placements.of.end() ? found->second : "replicate";
    if (view.tp == "replicate" && planned == "replicate") continue;
    const std::optional<Block> block = block_of(view.name);
    require(planned == view.tp || (block && planned == "replicate"), family,
            "tensor parallelism: the plan places " + view.name + " as '" + planned +
                "', but the model computes it as '" + view.tp + "'" +
                (block ? " or 'replicate'" : ""));
    if (block) settle(blocks, decided, *block, view, planned, family);
  }
  return blocks;
}

}  // namespace meshrun::models
