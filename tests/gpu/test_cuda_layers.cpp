// Each CUDA layer of common/cuda/ (layers.hpp, attention.hpp, experts.hpp)
// against its CPU twin in common/layers.hpp (vocabulary-parallel
// cross-entropy against the whole-vocabulary one; a mixture's token
// movement against its spec computed plainly), on random float32 inputs of
// shapes that leave partial blocks (37 rows of 300; a vocabulary of 1000 in
// shards of 400 and 600; 8 experts, top 2; attention over 70 and 33
// positions, tiles of 32, GQA groups of 2, head_dim 40 and 128):
// forward outputs, saved statistics, input gradients (accumulated into a
// non-zero buffer, or overwriting one) and weight gradients. Without a
// usable GPU it exits 77 (ctest: skipped).
//
// Tolerance: |gpu - cpu| <= 1e-5 + 1e-4 |cpu|. Both compute in float32;
// the GPU sums a row in a tree of 256 partial sums where the CPU sums it in
// order, which moves a sum of ~300 terms by a few ulp (~1e-6 relative), and
// CUDA's expf, tanhf and rsqrtf are within 2 ulp of the CPU's (libmvec
// under -ffast-math). 1e-4 relative leaves a margin of ~100 over that and
// still catches a wrong term, which is O(1) relative. Attention sums at most
// 70 x 2 terms per element with an online softmax where the CPU normalizes
// once; the same bound holds (differences ~1e-6 relative), and the absolute
// 1e-5 covers gradient elements that cancel to near zero.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/cuda/attention.hpp"
#include "common/cuda/experts.hpp"
#include "common/cuda/layers.hpp"
#include "common/layers.hpp"
#include "device_buffer.hpp"
#include "usable_devices.hpp"

namespace {

namespace cpu = meshrun::kernels;
namespace gpu = meshrun::kernels::cuda;

constexpr int64_t kRows = 37, kDim = 300, kVocab = 1000;
constexpr double kEps = 1e-5;

int failures = 0;

void compare(const std::string& what, const std::vector<float>& gpu_values,
             const std::vector<float>& cpu_values) {
  double worst = 0;
  bool within = gpu_values.size() == cpu_values.size();
  for (size_t i = 0; within && i < cpu_values.size(); ++i) {
    const double error = std::abs(double(gpu_values[i]) - double(cpu_values[i]));
    worst = std::max(worst, error);
    within = error <= 1e-5 + 1e-4 * std::abs(double(cpu_values[i]));
  }
  std::printf("%s %s (largest difference %.3g)\n", within ? "PASS" : "FAIL", what.c_str(), worst);
  if (!within) ++failures;
}

void check_rmsnorm() {
  const auto x = random_values(kRows * kDim, 0.0f, 1.0f, 1);
  const auto weight = random_values(kDim, 1.0f, 0.2f, 2);
  const auto dy = random_values(kRows * kDim, 0.0f, 1.0f, 3);
  const auto dx_start = random_values(kRows * kDim, 0.0f, 1.0f, 4);
  std::vector<float> y(x.size()), rstd(kRows), dx = dx_start, d_weight(kDim, 0.5f);
  DeviceBuffer<float> gx(x), gw(weight), gdy(dy), gy(y), grstd(rstd), gdx(dx), gdw(d_weight);
  cpu::rmsnorm_forward(y.data(), rstd.data(), x.data(), weight.data(), kRows, kDim, kEps);
  cpu::rmsnorm_backward(dx.data(), d_weight.data(), dy.data(), x.data(), weight.data(), rstd.data(),
                        kRows, kDim);
  require(gpu::rmsnorm_forward(gy.get(), grstd.get(), gx.get(), gw.get(), kRows, kDim, kEps, 0),
          "rmsnorm_forward");
  require(gpu::rmsnorm_backward(gdx.get(), gdw.get(), gdy.get(), gx.get(), gw.get(), grstd.get(),
                                kRows, kDim, 0),
          "rmsnorm_backward");
  compare("rmsnorm forward", gy.host(), y);
  compare("rmsnorm rstd", grstd.host(), rstd);
  compare("rmsnorm dx (accumulated)", gdx.host(), dx);
  compare("rmsnorm d_weight (accumulated)", gdw.host(), d_weight);
}

void check_layernorm() {
  const auto x = random_values(kRows * kDim, 0.3f, 1.0f, 5);
  const auto weight = random_values(kDim, 1.0f, 0.2f, 6);
  const auto bias = random_values(kDim, 0.0f, 0.2f, 7);
  const auto dy = random_values(kRows * kDim, 0.0f, 1.0f, 8);
  std::vector<float> y(x.size()), mean(kRows), rstd(kRows);
  std::vector<float> dx = random_values(kRows * kDim, 0.0f, 1.0f, 9);
  std::vector<float> d_weight(kDim, 0.25f), d_bias(kDim, -0.25f);
  DeviceBuffer<float> gx(x), gw(weight), gb(bias), gdy(dy), gy(y), gmean(mean), grstd(rstd),
      gdx(dx), gdw(d_weight), gdb(d_bias);
  cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), weight.data(), bias.data(),
                         kRows, kDim, kEps);
  cpu::layernorm_backward(dx.data(), d_weight.data(), d_bias.data(), dy.data(), x.data(),
                          weight.data(), mean.data(), rstd.data(), kRows, kDim);
  require(gpu::layernorm_forward(gy.get(), gmean.get(), grstd.get(), gx.get(), gw.get(), gb.get(),
                                 kRows, kDim, kEps, 0),
          "layernorm_forward");
  require(gpu::layernorm_backward(gdx.get(), gdw.get(), gdb.get(), gdy.get(), gx.get(), gw.get(),
                                  gmean.get(), grstd.get(), kRows, kDim, 0),
          "layernorm_backward");
  compare("layernorm forward", gy.host(), y);
  compare("layernorm mean", gmean.host(), mean);
  compare("layernorm rstd", grstd.host(), rstd);
  compare("layernorm dx (accumulated)", gdx.host(), dx);
  compare("layernorm d_weight (accumulated)", gdw.host(), d_weight);
  compare("layernorm d_bias (accumulated)", gdb.host(), d_bias);
}

void check_activations() {
  const auto gate_up = random_values(kRows * 2 * kDim, 0.0f, 2.0f, 10);
  const auto d_out = random_values(kRows * kDim, 0.0f, 1.0f, 11);
  std::vector<float> out(kRows * kDim), d_gate_up(gate_up.size());
  DeviceBuffer<float> ggu(gate_up), gdo(d_out), gout(out), gdgu(d_gate_up);
  cpu::swiglu_forward(out.data(), gate_up.data(), kRows, kDim);
  cpu::swiglu_backward(d_gate_up.data(), d_out.data(), gate_up.data(), kRows, kDim);
  require(gpu::swiglu_forward(gout.get(), ggu.get(), kRows, kDim, 0), "swiglu_forward");
  require(gpu::swiglu_backward(gdgu.get(), gdo.get(), ggu.get(), kRows, kDim, 0),
          "swiglu_backward");
  compare("swiglu forward", gout.host(), out);
  compare("swiglu backward", gdgu.host(), d_gate_up);

  const auto x = random_values(kRows * kDim, 0.0f, 2.0f, 12);
  std::vector<float> y(x.size()), dx(x.size());
  DeviceBuffer<float> gx(x), gy(y), gdx(dx);
  cpu::gelu_forward(y.data(), x.data(), int64_t(x.size()));
  cpu::gelu_backward(dx.data(), d_out.data(), x.data(), int64_t(x.size()));
  require(gpu::gelu_forward(gy.get(), gx.get(), int64_t(x.size()), 0), "gelu_forward");
  require(gpu::gelu_backward(gdx.get(), gdo.get(), gx.get(), int64_t(x.size()), 0),
          "gelu_backward");
  compare("gelu forward", gy.host(), y);
  compare("gelu backward", gdx.host(), dx);
}

void check_cross_entropy() {
  std::vector<float> logits = random_values(kRows * kVocab, 0.0f, 3.0f, 13);
  std::vector<int32_t> targets(kRows);
  for (int64_t r = 0; r < kRows; ++r) targets[size_t(r)] = int32_t((r * 271) % kVocab);
  const std::vector<float> zeros(kRows, 0.0f);
  DeviceBuffer<float> glogits(logits), gloss(zeros);
  DeviceBuffer<int32_t> gtargets(targets);
  const double loss = cpu::cross_entropy_forward(logits.data(), targets.data(), kRows, kVocab);
  require(gpu::cross_entropy_forward(glogits.get(), gloss.get(), gtargets.get(), kRows, kVocab, 0),
          "cross_entropy_forward");
  const std::vector<float> row_loss = gloss.host();
  double gpu_loss = 0;
  for (const float value : row_loss) gpu_loss += value;
  compare("cross-entropy probabilities", glogits.host(), logits);
  compare("cross-entropy mean loss", {float(gpu_loss / kRows)}, {float(loss)});
  cpu::cross_entropy_backward(logits.data(), targets.data(), kRows, kVocab, 0.5f);
  require(gpu::cross_entropy_backward(glogits.get(), gtargets.get(), kRows, kVocab, 0.5f, 0),
          "cross_entropy_backward");
  compare("cross-entropy backward", glogits.host(), logits);
}

// Two tp ranks' shards of the vocabulary, [0, 400) and [400, 1000), each
// through the vocabulary-parallel steps on the device, the all-reduces
// between them made on the host; against the CPU's whole-vocabulary
// cross-entropy: the shards' probabilities and gradients are its columns,
// the rows' losses its mean.
void check_vocab_parallel_cross_entropy() {
  const std::vector<float> logits = random_values(kRows * kVocab, 0.0f, 3.0f, 18);
  std::vector<int32_t> targets(kRows);
  for (int64_t r = 0; r < kRows; ++r) targets[size_t(r)] = int32_t((r * 271) % kVocab);
  std::vector<float> probs = logits;
  const double loss = cpu::cross_entropy_forward(probs.data(), targets.data(), kRows, kVocab);
  std::vector<float> grads = probs;
  cpu::cross_entropy_backward(grads.data(), targets.data(), kRows, kVocab, 0.5f);

  const int64_t begins[2] = {0, 400}, sizes[2] = {400, kVocab - 400};
  std::vector<std::unique_ptr<DeviceBuffer<float>>> shards, maxima, sums, losses;
  std::vector<float> row_max(kRows, -INFINITY), total(2 * kRows, 0.0f);
  DeviceBuffer<int32_t> gtargets(targets);
  for (int s = 0; s < 2; ++s) {
    std::vector<float> shard(size_t(kRows * sizes[s]));
    for (int64_t r = 0; r < kRows; ++r) {
      std::copy_n(logits.begin() + r * kVocab + begins[s], sizes[s], shard.begin() + r * sizes[s]);
    }
    shards.push_back(std::make_unique<DeviceBuffer<float>>(shard));
    maxima.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(kRows)));
    sums.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(2 * kRows)));
    losses.push_back(std::make_unique<DeviceBuffer<float>>(std::vector<float>(kRows)));
    require(gpu::vocab_parallel_row_max(maxima[s]->get(), shards[s]->get(), kRows, sizes[s], 0),
            "vocab_parallel_row_max");
    const std::vector<float> local = maxima[s]->host();
    for (int64_t r = 0; r < kRows; ++r)
      row_max[size_t(r)] = std::max(row_max[size_t(r)], local[size_t(r)]);
  }
  for (int s = 0; s < 2; ++s) {
    maxima[s] = std::make_unique<DeviceBuffer<float>>(row_max);  // the all-reduced maxima
    require(gpu::vocab_parallel_exponentials(shards[s]->get(), sums[s]->get(), maxima[s]->get(),
                                             gtargets.get(), kRows, begins[s], sizes[s], 0),
            "vocab_parallel_exponentials");
    const std::vector<float> local = sums[s]->host();
    for (size_t i = 0; i < total.size(); ++i) total[i] += local[i];
  }
  std::vector<float> gpu_probs(probs.size()), gpu_grads(grads.size());
  for (int s = 0; s < 2; ++s) {
    sums[s] = std::make_unique<DeviceBuffer<float>>(total);  // the all-reduced sums
    require(gpu::vocab_parallel_probabilities(shards[s]->get(), losses[s]->get(), sums[s]->get(),
                                              maxima[s]->get(), kRows, sizes[s], 0),
            "vocab_parallel_probabilities");
    const std::vector<float> shard_probs = shards[s]->host();
    require(gpu::vocab_parallel_cross_entropy_backward(shards[s]->get(), gtargets.get(), kRows,
                                                       begins[s], sizes[s], 0.5f, 0),
            "vocab_parallel_cross_entropy_backward");
    const std::vector<float> shard_grads = shards[s]->host();
    for (int64_t r = 0; r < kRows; ++r) {
      std::copy_n(shard_probs.begin() + r * sizes[s], sizes[s],
                  gpu_probs.begin() + r * kVocab + begins[s]);
      std::copy_n(shard_grads.begin() + r * sizes[s], sizes[s],
                  gpu_grads.begin() + r * kVocab + begins[s]);
    }
  }
  double gpu_loss = 0;
  for (const float value : losses[0]->host()) gpu_loss += value;
  compare("vocab-parallel cross-entropy probabilities (2 shards)", gpu_probs, probs);
  compare("vocab-parallel cross-entropy mean loss (both shards' rows agree)",
          {float(gpu_loss / kRows)}, {float(loss)});
  compare("vocab-parallel cross-entropy rows' losses, shard 1 = shard 0", losses[1]->host(),
          losses[0]->host());
  compare("vocab-parallel cross-entropy backward", gpu_grads, grads);
}

void compare_exactly(const std::string& what, bool equal) {
  std::printf("%s %s\n", equal ? "PASS" : "FAIL", what.c_str());
  if (!equal) ++failures;
}

// A mixture's token movement (common/cuda/experts.hpp) against the spec,
// computed here the plain way: the top K experts of a row are the first K
// of its experts sorted by descending probability, a stable sort (so ties
// go to the lower expert); dispatch order is the slots stably sorted by
// expert. 37 rows, 8 experts, top 2, rows of 300; row 5 has a tie.
void check_experts() {
  constexpr int64_t kExperts = 8, kTopK = 2, kSlots = kRows * kTopK;
  std::vector<float> probs = random_values(kRows * kExperts, 0.0f, 1.0f, 19);
  for (int64_t n = 0; n < kRows; ++n) {  // softmax rows, as the router makes them
    float* row = probs.data() + n * kExperts;
    float sum = 0;
    for (int64_t e = 0; e < kExperts; ++e) sum += row[e] = std::exp(row[e]);
    for (int64_t e = 0; e < kExperts; ++e) row[e] /= sum;
  }
  probs[5 * kExperts + 6] = probs[5 * kExperts + 2] = 0.4f;  // a tie at the top
  std::vector<int32_t> selected(kSlots);
  std::vector<float> weights(kSlots);
  for (int64_t n = 0; n < kRows; ++n) {
    std::vector<int32_t> order(kExperts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return probs[size_t(n * kExperts + a)] > probs[size_t(n * kExperts + b)];
    });
    float sum = 0;
    for (int64_t k = 0; k < kTopK; ++k) sum += probs[size_t(n * kExperts + order[size_t(k)])];
    for (int64_t k = 0; k < kTopK; ++k) {
      selected[size_t(n * kTopK + k)] = order[size_t(k)];
      weights[size_t(n * kTopK + k)] = probs[size_t(n * kExperts + order[size_t(k)])] / sum;
    }
  }
  std::vector<int64_t> by_expert(kSlots), position(kSlots), tokens(kExperts, 0);
  std::iota(by_expert.begin(), by_expert.end(), 0);
  std::stable_sort(by_expert.begin(), by_expert.end(),
                   [&](int64_t a, int64_t b) { return selected[size_t(a)] < selected[size_t(b)]; });
  for (int64_t p = 0; p < kSlots; ++p) position[size_t(by_expert[size_t(p)])] = p;
  for (const int32_t e : selected) ++tokens[size_t(e)];

  const auto x = random_values(kRows * kDim, 0.0f, 1.0f, 20);
  const auto expert_out = random_values(kSlots * kDim, 0.0f, 1.0f, 21);
  const auto dy = random_values(kRows * kDim, 0.0f, 1.0f, 22);
  std::vector<float> slots(kSlots * kDim), y(kRows * kDim, 0.0f), d_slots(kSlots * kDim),
      d_weights(kSlots), dx(kRows * kDim, 0.0f);
  for (int64_t s = 0; s < kSlots; ++s) {
    const int64_t n = s / kTopK, at = position[size_t(s)] * kDim;
    float dot = 0;
    for (int64_t i = 0; i < kDim; ++i) {
      slots[size_t(at + i)] = x[size_t(n * kDim + i)];
      y[size_t(n * kDim + i)] += weights[size_t(s)] * expert_out[size_t(at + i)];
      d_slots[size_t(at + i)] = weights[size_t(s)] * dy[size_t(n * kDim + i)];
      dot += dy[size_t(n * kDim + i)] * expert_out[size_t(at + i)];
      dx[size_t(n * kDim + i)] += d_slots[size_t(at + i)];
    }
    d_weights[size_t(s)] = dot;
  }

  DeviceBuffer<float> gprobs(probs), gweights{std::vector<float>(kSlots)}, gx(x),
      gexpert_out(expert_out), gdy(dy), gslots(slots), gy(y), gd_slots(d_slots),
      gd_weights(d_weights), gdx(dx);
  DeviceBuffer<int32_t> gselected{std::vector<int32_t>(kSlots)};
  DeviceBuffer<int64_t> gtokens{std::vector<int64_t>(kExperts)},
      gposition{std::vector<int64_t>(kSlots)};
  require(gpu::moe_route(gselected.get(), gweights.get(), gprobs.get(), kRows, kExperts, kTopK, 0),
          "moe_route");
  require(gpu::moe_order_slots(gtokens.get(), gposition.get(), gselected.get(), kRows, kExperts,
                               kTopK, 0),
          "moe_order_slots");
  compare_exactly("moe route: the experts chosen, ties to the lower", gselected.host() == selected);
  compare("moe route: the renormalized weights", gweights.host(), weights);
  compare_exactly("moe order: tokens per expert", gtokens.host() == tokens);
  compare_exactly("moe order: slot positions, stable within an expert",
                  gposition.host() == position);
  DeviceBuffer<int64_t> exact_position(position);  // the rest on the oracle's order
  require(gpu::moe_dispatch(gslots.get(), gx.get(), exact_position.get(), kRows, kTopK, kDim, 0),
          "moe_dispatch");
  require(gpu::moe_combine(gy.get(), gexpert_out.get(), gweights.get(), exact_position.get(), kRows,
                           kTopK, kDim, 0),
          "moe_combine");
  require(gpu::moe_combine_backward(gd_slots.get(), gd_weights.get(), gdy.get(), gexpert_out.get(),
                                    gweights.get(), exact_position.get(), kRows, kTopK, kDim, 0),
          "moe_combine_backward");
  require(gpu::moe_dispatch_backward(gdx.get(), gd_slots.get(), exact_position.get(), kRows, kTopK,
                                     kDim, 0),
          "moe_dispatch_backward");
  compare("moe dispatch", gslots.host(), slots);
  compare("moe combine", gy.host(), y);
  compare("moe combine backward: the slots' gradients", gd_slots.host(), d_slots);
  compare("moe combine backward: the weights' gradients", gd_weights.host(), d_weights);
  compare("moe dispatch backward", gdx.host(), dx);
}

void check_embedding() {
  constexpr int64_t kTable = 50;
  const auto table = random_values(kTable * kDim, 0.0f, 1.0f, 14);
  const auto d_out = random_values(kRows * kDim, 0.0f, 1.0f, 15);
  std::vector<int32_t> tokens(kRows);
  for (int64_t r = 0; r < kRows; ++r) tokens[size_t(r)] = int32_t((r * 7) % 11);  // repeats
  std::vector<float> out(kRows * kDim), d_table = random_values(kTable * kDim, 0.0f, 1.0f, 16);
  DeviceBuffer<float> gtable(table), gdo(d_out), gout(out), gdt(d_table);
  DeviceBuffer<int32_t> gtokens(tokens);
  cpu::embedding_forward(out.data(), tokens.data(), table.data(), kRows, kDim);
  cpu::embedding_backward(d_table.data(), tokens.data(), d_out.data(), kRows, kDim);
  require(
      gpu::embedding_forward(gout.get(), gtokens.get(), gtable.get(), kRows, kDim, 0, kTable, 0),
      "embedding_forward");
  require(gpu::embedding_backward(gdt.get(), gtokens.get(), gdo.get(), kRows, kDim, 0, kTable, 0),
          "embedding_backward");
  compare("embedding forward", gout.host(), out);
  compare("embedding d_table (accumulated, repeated tokens)", gdt.host(), d_table);
}

void check_rotary() {
  constexpr int64_t kBatch = 2, kSeq = 45, kHeads = 3, kHeadDim = 40, kStride = 200;
  const cpu::RotaryTable<float> table(kHeadDim, kSeq, 10000.0);
  std::vector<float> x = random_values(kBatch * kSeq * kStride, 0.0f, 1.0f, 17);
  DeviceBuffer<float> gx(x), gcos(table.cos), gsin(table.sin);
  cpu::rotary_forward(x.data(), table, kBatch, kSeq, kHeads, kStride);
  require(gpu::rotary_forward(gx.get(), gcos.get(), gsin.get(), kBatch, kSeq, kHeads, kHeadDim,
                              table.half_dim, kStride, 0),
          "rotary_forward");
  compare("rotary forward (the first heads of each row; the rest untouched)", gx.host(), x);
  cpu::rotary_backward(x.data(), table, kBatch, kSeq, kHeads, kStride);
  require(gpu::rotary_backward(gx.get(), gcos.get(), gsin.get(), kBatch, kSeq, kHeads, kHeadDim,
                               table.half_dim, kStride, 0),
          "rotary_backward");
  compare("rotary backward", gx.host(), x);
}

// Causal grouped-query attention forward and backward, against the CPU's
// blocked GEMM version, on a shape that leaves partial tiles and warps.
void check_attention(const cpu::AttentionShape& shape, unsigned seed) {
  const std::string name = "attention b" + std::to_string(shape.batch) + " t" +
                           std::to_string(shape.seq_len) + " h" + std::to_string(shape.heads) +
                           "/" + std::to_string(shape.kv_heads) + " d" +
                           std::to_string(shape.head_dim);
  const int64_t rows = shape.batch * shape.seq_len;
  const auto qkv = random_values(rows * shape.qkv_dim(), 0.0f, 1.0f, seed);
  const auto d_out = random_values(rows * shape.q_dim(), 0.0f, 1.0f, seed + 1);
  std::vector<float> out(rows * shape.q_dim()), lse(shape.lse_size());
  std::vector<float> d_qkv(qkv.size()), scores(shape.scores_size()), d_scores(shape.scores_size());
  cpu::attention_forward(out.data(), lse.data(), scores.data(), qkv.data(), shape);
  cpu::attention_backward(d_qkv.data(), scores.data(), d_scores.data(), d_out.data(), qkv.data(),
                          lse.data(), shape);
  DeviceBuffer<float> gqkv(qkv), gdo(d_out), gout(out), glse(lse), gdots(lse),
      gdqkv(random_values(qkv.size(), 0.0f, 1.0f, seed + 2));  // overwritten
  const gpu::AttentionDims dims{shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                                shape.head_dim};
  require(gpu::attention_forward(gout.get(), glse.get(), gqkv.get(), dims, 0), "attention_forward");
  require(gpu::attention_backward(gdqkv.get(), gdots.get(), gdo.get(), gout.get(), gqkv.get(),
                                  glse.get(), dims, 0),
          "attention_backward");
  compare(name + " forward", gout.host(), out);
  compare(name + " log-sum-exps", glse.host(), lse);
  compare(name + " d_qkv (q, k and v)", gdqkv.host(), d_qkv);
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  check_rmsnorm();
  check_layernorm();
  check_activations();
  check_cross_entropy();
  check_vocab_parallel_cross_entropy();
  check_experts();
  check_embedding();
  check_rotary();
  check_attention({2, 70, 4, 2, 40}, 20);
  check_attention({1, 33, 2, 1, 128}, 30);
  std::printf("%d of the CUDA layers' checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
