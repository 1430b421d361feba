#include "common/tensor_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/layers.hpp"

namespace meshrun::models {

VocabShard vocab_shard(int64_t vocab, const TensorParallelGroup& tp) {
  const int64_t size = vocab / tp.size();
  return {tp.rank() * size, size};
}

void SingleRank::all_gather(const float* send, float* recv, int64_t count) {
  std::copy_n(send, count, recv);
}

void SingleRank::reduce_scatter_sum(const float* send, float* recv, int64_t count) {
  std::copy_n(send, count, recv);
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
                                      TensorParallelGroup& tp) {
  if (tp.size() == 1) {
    kernels::embedding_forward(out, tokens, table, rows, dim);
    return;
  }
  vocab_parallel_embedding_lookup(out, tokens, table, rows, dim, shard);
  tp.all_reduce_sum(out, rows * dim);
}

void vocab_parallel_embedding_lookup(float* out, const int32_t* tokens, const float* table,
                                     int64_t rows, int64_t dim, const VocabShard& shard) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = out + r * dim;
    if (shard.holds(tokens[r])) {
      std::copy_n(table + (tokens[r] - shard.begin) * dim, dim, row);
    } else {
      std::fill_n(row, dim, 0.0f);
    }
  }
}

void vocab_parallel_embedding_backward(float* d_table, const int32_t* tokens, const float* d_out,
                                       int64_t rows, int64_t dim, const VocabShard& shard) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!shard.holds(tokens[r])) continue;
    float* d_row = d_table + (tokens[r] - shard.begin) * dim;
    for (int64_t i = 0; i < dim; ++i) d_row[i] += d_out[r * dim + i];
  }
}

double vocab_parallel_cross_entropy_forward(float* logits, const int32_t* targets, int64_t rows,
                                            const VocabShard& shard, TensorParallelGroup& tp) {
  if (tp.size() == 1) return kernels::cross_entropy_forward(logits, targets, rows, shard.size);
  std::vector<float> row_max(static_cast<size_t>(rows)), sums(static_cast<size_t>(2 * rows), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* z = logits + r * shard.size;
    row_max[size_t(r)] = *std::max_element(z, z + shard.size);
  }
  tp.all_reduce_max(row_max.data(), rows);
  // sums: the exp-sums [0, N), then the target logits [N, 2N).
  for (int64_t r = 0; r < rows; ++r) {
    float* z = logits + r * shard.size;
    if (shard.holds(targets[r])) sums[size_t(rows + r)] = z[targets[r] - shard.begin];
    float sum = 0;
    for (int64_t v = 0; v < shard.size; ++v) {
      z[v] = std::exp(z[v] - row_max[size_t(r)]);
      sum += z[v];
    }
    sums[size_t(r)] = sum;
  }
  tp.all_reduce_sum(sums.data(), 2 * rows);
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    float* z = logits + r * shard.size;
    const float inv_sum = 1.0f / sums[size_t(r)];
    for (int64_t v = 0; v < shard.size; ++v) z[v] *= inv_sum;
    total += double(std::log(sums[size_t(r)]) + row_max[size_t(r)] - sums[size_t(rows + r)]);
  }
  return total / double(rows);
}

void vocab_parallel_cross_entropy_backward(float* probs, const int32_t* targets, int64_t rows,
                                           const VocabShard& shard, float scale) {
  const float factor = scale / float(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* p = probs + r * shard.size;
    if (shard.holds(targets[r])) p[targets[r] - shard.begin] -= 1.0f;
    for (int64_t v = 0; v < shard.size; ++v) p[v] *= factor;
  }
}

Placements plan_placements(const char* plan_json) {
  Placements placements;
  const auto plan = nlohmann::json::parse(plan_json != nullptr ? plan_json : "{}");
  placements.sequence_parallel = plan.value("sequence_parallel", false);
  if (!plan.contains("parameters")) return placements;
  for (const auto& parameter : plan.at("parameters")) {
    placements.of[parameter.at("name").get<std::string>()] =
        parameter.value("tp", std::string("replicate"));
  }
  return placements;
}

}  // namespace meshrun::models
