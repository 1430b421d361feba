// Every call of the GPU's compute (common/cuda/compute.hpp) against the
// host's (common/compute.hpp), which the kit's layer computes through: each
// call runs once on host buffers through the host's compute and once on
// device copies of them through the GPU's, and every buffer must agree
// afterwards. The GEMMs of both weight layouts in float32 and under the
// bfloat16 matmul precision (the weight's bfloat16 copy given or not), the
// bias, the element-wise helpers, the norms, the activations, the
// embedding (whole and a vocabulary shard), rotary (a partial rotary_dim
// too), attention (one rank's, and ring attention's steps over cp ranks),
// the strided copy and fill, and cross-entropy (whole and the vocabulary-parallel
// steps, with the mean loss each returns) and a mixture of experts' steps
// (8 experts, top 2: the experts chosen, the slot order and the tokens per
// expert exactly), on shapes that leave partial blocks (37 rows, 70
// positions). Without a usable GPU it exits 77.
//
// Tolerance: |gpu - cpu| <= 1e-5 + 1e-4 |cpu|, as the CUDA layers' test
// (test_cuda_layers.cpp, where it is justified) for the kernels they share.
// The GEMMs sum at most 48 products of inputs of spread 0.1 in another
// order than oneDNN (both in float32, the bfloat16 operands rounded alike
// to nearest even, their products exact), which moves a sum by a few ulp
// of the sum of |terms| (< 1e-6 here), well inside it. Copies, zeroing,
// rounding and the bias's row-ordered sums must agree exactly and do under
// this bound too.
//
// This test has compiled but never run on a GPU (docs/testing.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/compute.hpp"
#include "common/cuda/compute.hpp"
#include "device_buffer.hpp"
#include "numeric/bfloat16.hpp"
#include "numeric/gemm.hpp"
#include "usable_devices.hpp"

namespace {

using meshrun::models::Compute;
using meshrun::models::WeightLayout;
namespace kernels = meshrun::kernels;

constexpr int64_t kRows = 37;
constexpr double kEps = 1e-5;

int failures = 0;

// What a call reads and writes: float buffers, indices (tokens, positions
// or targets), a weight's bfloat16 bits, and floats of scratch (each
// compute's own contents, not compared).
struct Operands {
  std::vector<std::vector<float>> floats;
  std::vector<int32_t> indices;
  std::vector<uint16_t> bits;
  int64_t scratch = 0;
};

// The same operands as a compute sees them.
struct Pointers {
  std::vector<float*> floats;
  const int32_t* indices;
  const uint16_t* bits;
  float* scratch;
};

using Call = std::function<void(Compute&, const Pointers&)>;

void compare(const std::string& what, size_t buffer, const std::vector<float>& gpu,
             const std::vector<float>& cpu) {
  double worst = 0;
  bool within = true;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double error = std::abs(double(gpu[i]) - double(cpu[i]));
    worst = std::max(worst, error);
    within = within && error <= 1e-5 + 1e-4 * std::abs(double(cpu[i]));
  }
  std::printf("%s %s, buffer %zu (largest difference %.3g)\n", within ? "PASS" : "FAIL",
              what.c_str(), buffer, worst);
  if (!within) ++failures;
}

// `call` on the host's compute over `operands` and on `gpu` over device
// copies; every float buffer compared.
void check(const std::string& what, Compute& gpu, Operands operands, const Call& call) {
  std::vector<std::unique_ptr<DeviceBuffer<float>>> device;
  for (const auto& values : operands.floats) {
    device.push_back(std::make_unique<DeviceBuffer<float>>(values));
  }
  DeviceBuffer<int32_t> indices(operands.indices.empty() ? std::vector<int32_t>{0}
                                                         : operands.indices);
  DeviceBuffer<uint16_t> bits(operands.bits.empty() ? std::vector<uint16_t>{0} : operands.bits);
  std::vector<float> host_scratch(size_t(operands.scratch) + 1);
  DeviceBuffer<float> device_scratch(host_scratch);
  Pointers on_device{
      {}, indices.get(), operands.bits.empty() ? nullptr : bits.get(), device_scratch.get()};
  for (auto& buffer : device) on_device.floats.push_back(buffer->get());
  Pointers on_host{{},
                   operands.indices.data(),
                   operands.bits.empty() ? nullptr : operands.bits.data(),
                   host_scratch.data()};
  for (auto& values : operands.floats) on_host.floats.push_back(values.data());

  call(meshrun::models::host_compute(), on_host);
  call(gpu, on_device);
  for (size_t k = 0; k < operands.floats.size(); ++k) {
    compare(what, k, device[k]->host(), operands.floats[k]);
  }
}

std::vector<float> values(size_t count, unsigned seed, float mean = 0.0f, float spread = 1.0f) {
  return random_values(count, mean, spread, seed);
}

void check_linears(Compute& gpu) {
  constexpr int64_t in = 48, out = 40;
  for (const bool bfloat16 : {false, true}) {
    kernels::MatmulPrecisionScope precision(bfloat16 ? kernels::MatmulPrecision::bfloat16
                                                     : kernels::MatmulPrecision::float32);
    for (const WeightLayout layout : {WeightLayout::out_in, WeightLayout::in_out}) {
      for (const bool with_bits : {false, true}) {
        if (with_bits && !bfloat16) continue;
        const std::string name = std::string(bfloat16 ? "bfloat16" : "float32") +
                                 (layout == WeightLayout::out_in ? " [out, in]" : " [in, out]") +
                                 (with_bits ? " with the weight's bits" : "");
        Operands operands{
            {values(size_t(in * out), 1, 0.0f, 0.1f), values(size_t(kRows * in), 2, 0.0f, 0.1f),
             values(size_t(kRows * out), 3, 0.0f, 0.1f), values(size_t(kRows * out), 4),
             values(size_t(kRows * in), 5), values(size_t(in * out), 6)},
            {},
            {}};
        if (with_bits) {
          operands.bits.resize(operands.floats[0].size());
          kernels::to_bfloat16(operands.floats[0].data(), operands.bits.data(),
                               int64_t(operands.bits.size()));
        }
        check("linear " + name, gpu, operands, [&](Compute& compute, const Pointers& p) {
          const kernels::Weight<float> weight(p.floats[0], p.bits);
          compute.linear_forward(layout, p.floats[3], p.floats[1], weight, kRows, in, out);
          compute.linear_backward_input(layout, p.floats[4], p.floats[2], weight, kRows, in, out);
          compute.linear_backward_weight(layout, p.floats[5], p.floats[2], p.floats[1], kRows, in,
                                         out);
        });
      }
    }
  }
}

void check_vectors(Compute& gpu) {
  constexpr int64_t dim = 300, count = kRows * dim;
  check("bias", gpu, {{values(dim, 1), values(count, 2), values(count, 3), values(dim, 4)}, {}, {}},
        [](Compute& compute, const Pointers& p) {
          compute.bias_forward(p.floats[1], p.floats[0], kRows, dim);
          compute.bias_backward(p.floats[3], p.floats[2], kRows, dim);
        });
  check("add, accumulate, copy, zero, round", gpu,
        {{values(count, 1), values(count, 2), values(count, 3), values(count, 4), values(count, 5),
          values(count, 6)},
         {},
         {}},
        [](Compute& compute, const Pointers& p) {
          compute.add(p.floats[2], p.floats[0], p.floats[1], count);
          compute.add(p.floats[0], p.floats[0], p.floats[1], count);
          compute.accumulate(p.floats[3], p.floats[1], count);
          compute.copy(p.floats[4], p.floats[1], count);
          compute.zero(p.floats[5], count - 1);
          compute.round_to_bfloat16(p.floats[1], count);
        });
  check("strided copy, fill", gpu, {{values(count, 1), values(count, 2), values(count, 3)}, {}, {}},
        [](Compute& compute, const Pointers& p) {
          compute.copy_rows(p.floats[1] + 7, dim, p.floats[0] + 100, dim, kRows, 150);
          compute.fill(p.floats[2], count - 1, -1e30f);
        });
}

void check_norms(Compute& gpu) {
  constexpr int64_t dim = 300, count = kRows * dim;
  check("rmsnorm", gpu,
        {{values(count, 1), values(dim, 2, 1.0f, 0.2f), values(count, 3), values(count, 4),
          values(kRows, 5), values(count, 6), values(dim, 7)},
         {},
         {}},
        [](Compute& compute, const Pointers& p) {
          compute.rmsnorm_forward(p.floats[3], p.floats[4], p.floats[0], p.floats[1], kRows, dim,
                                  kEps);
          compute.rmsnorm_backward(p.floats[5], p.floats[6], p.floats[2], p.floats[0], p.floats[1],
                                   p.floats[4], kRows, dim);
        });
  check("layernorm", gpu,
        {{values(count, 1), values(dim, 2, 1.0f, 0.2f), values(dim, 3), values(count, 4),
          values(count, 5), values(kRows, 6), values(kRows, 7), values(count, 8), values(dim, 9),
          values(dim, 10)},
         {},
         {}},
        [](Compute& compute, const Pointers& p) {
          compute.layernorm_forward(p.floats[4], p.floats[5], p.floats[6], p.floats[0], p.floats[1],
                                    p.floats[2], kRows, dim, kEps);
          compute.layernorm_backward(p.floats[7], p.floats[8], p.floats[9], p.floats[3],
                                     p.floats[0], p.floats[1], p.floats[5], p.floats[6], kRows,
                                     dim);
        });
}

void check_activations(Compute& gpu) {
  constexpr int64_t dim = 300, count = kRows * dim;
  check("swiglu", gpu,
        {{values(2 * count, 1), values(count, 2), values(count, 3), values(2 * count, 4)}, {}, {}},
        [](Compute& compute, const Pointers& p) {
          compute.swiglu_forward(p.floats[2], p.floats[0], kRows, dim);
          compute.swiglu_backward(p.floats[3], p.floats[1], p.floats[0], kRows, dim);
        });
  check("gelu, the backward in place", gpu,
        {{values(count, 1), values(count, 2), values(count, 3)}, {}, {}},
        [](Compute& compute, const Pointers& p) {
          compute.gelu_forward(p.floats[2], p.floats[0], count);
          compute.gelu_backward(p.floats[1], p.floats[1], p.floats[0], count);
        });
}

// The whole table, and a shard of rows [5, 12) as a vocabulary-parallel
// rank holds it (rows of other tokens zero, their gradients dropped).
void check_embedding(Compute& gpu) {
  constexpr int64_t vocab = 13, dim = 64;
  std::vector<int32_t> indices(kRows);
  for (int64_t r = 0; r < kRows; ++r) indices[size_t(r)] = int32_t((r * 7) % vocab);  // repeats
  for (const auto& [begin, size] : {std::pair<int64_t, int64_t>{0, vocab}, {5, 7}}) {
    const int64_t first = begin, count = size;
    check(
        "embedding over rows [" + std::to_string(first) + ", " + std::to_string(first + count) +
            ")",
        gpu,
        {{values(size_t(count * dim), 1), values(kRows * dim, 2), values(kRows * dim, 3),
          values(size_t(count * dim), 4)},
         indices,
         {}},
        [first, count](Compute& compute, const Pointers& p) {
          compute.embedding_forward(p.floats[2], p.indices, p.floats[0], kRows, dim, first, count);
          compute.embedding_backward(p.floats[3], p.indices, p.floats[1], kRows, dim, first, count);
        });
  }
}

// Causal grouped-query attention, forward and backward: 70 rows in query
// blocks of 32 on the host, GQA groups of 2, head_dim 40.
void check_attention(Compute& gpu) {
  kernels::AttentionShape shape;
  shape.batch = 2;
  shape.seq_len = 70;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 40;
  shape.query_block = 32;
  const auto rows = size_t(shape.batch * shape.seq_len);
  Operands operands{
      {values(rows * size_t(shape.qkv_dim()), 1), values(rows * size_t(shape.q_dim()), 2),
       values(rows * size_t(shape.q_dim()), 3), values(size_t(shape.lse_size()), 4),
       values(rows * size_t(shape.qkv_dim()), 5)},
      {},
      {},
      std::max(meshrun::models::host_compute().attention_scratch(shape),
               gpu.attention_scratch(shape))};
  check("attention", gpu, operands, [&shape](Compute& compute, const Pointers& p) {
    compute.attention_forward(shape, p.floats[2], p.floats[3], p.floats[0], p.scratch);
    compute.attention_backward(shape, p.floats[4], p.floats[1], p.floats[0], p.floats[2],
                               p.floats[3], p.scratch);
  });
}

// Ring attention's steps over cp ranks: 4 chunks of 20 rows a side (tiles
// of 32 rows cross chunks), the queries' chunks {0, 7, 2, 5} (a rank's
// gathered rows under cp 4, Ulysses 2), one block of the same chunks (the
// causal diagonal) and one of chunks {1, 6, 3, 4} (every query sees some of
// it, chunk 0 none, chunk 7 all): both merged, finished, and both blocks'
// gradients added up.
void check_ring_attention(Compute& gpu) {
  kernels::AttentionShape g;
  g.batch = 2;
  g.seq_len = 80;
  g.heads = 4;
  g.kv_heads = 2;
  g.head_dim = 40;
  g.query_block = 16;
  const kernels::RingBlock own{20, {0, 7, 2, 5}, {0, 7, 2, 5}};
  const kernels::RingBlock other{20, {0, 7, 2, 5}, {1, 6, 3, 4}};
  const auto rows = size_t(g.batch * g.seq_len), stats = size_t(g.lse_size());
  const auto kv = rows * size_t(2 * g.kv_dim()), q = rows * size_t(g.q_dim());
  Operands operands{
      {values(rows * size_t(g.qkv_dim()), 1), values(kv, 2), values(kv, 3), values(q, 4),
       values(stats, 5), values(stats, 6), values(stats, 7), values(q, 8), values(stats, 9),
       values(rows * size_t(g.qkv_dim()), 10), values(kv, 11)},
      {},
      {},
      std::max(meshrun::models::host_compute().ring_attention_scratch(g, own.chunk),
               gpu.ring_attention_scratch(g, own.chunk))};
  check("ring attention", gpu, operands, [&](Compute& compute, const Pointers& p) {
    float *acc = p.floats[3], *row_max = p.floats[4], *row_sum = p.floats[5];
    compute.zero(acc, int64_t(q));
    compute.fill(row_max, int64_t(stats), -1e30f);
    compute.zero(row_sum, int64_t(stats));
    for (const auto& [block, keys] :
         {std::pair{&own, p.floats[1]}, std::pair{&other, p.floats[2]}}) {
      compute.ring_attention_merge(g, *block, acc, row_max, row_sum, p.floats[0], keys, p.scratch);
    }
    compute.ring_attention_finish(g, acc, p.floats[6], row_max, row_sum);
    compute.ring_attention_output_dots(g, p.floats[8], acc, p.floats[7]);
    compute.zero(p.floats[9], int64_t(rows) * g.qkv_dim());
    compute.zero(p.floats[10], int64_t(kv));
    for (const auto& [block, keys] :
         {std::pair{&own, p.floats[1]}, std::pair{&other, p.floats[2]}}) {
      compute.ring_attention_block_backward(g, *block, p.floats[9], p.floats[10], p.floats[0], keys,
                                            p.floats[7], p.floats[6], p.floats[8], p.scratch);
    }
  });
}

// The whole vocabulary's cross-entropy, and a rank's steps of the
// vocabulary-parallel one over columns [300, 700) of 1000 (the tp
// all-reduces between them are the caller's; here the rank's own values
// stand for the sums); the mean losses returned compared too.
void check_cross_entropy(Compute& gpu) {
  constexpr int64_t vocab = 1000, begin = 300, size = 400;
  std::vector<int32_t> targets(kRows);
  for (int64_t r = 0; r < kRows; ++r) targets[size_t(r)] = int32_t((r * 97) % vocab);
  double losses[2] = {0, 0};
  const auto loss_of = [&](Compute& compute) -> double& { return losses[&compute == &gpu]; };
  const auto compare_losses = [&](const std::string& what) {
    compare(what + ": the mean loss", 0, {float(losses[1])}, {float(losses[0])});
  };
  check("cross-entropy", gpu, {{values(kRows * vocab, 1, 0.0f, 3.0f)}, targets, {}},
        [&](Compute& compute, const Pointers& p) {
          loss_of(compute) = compute.cross_entropy_forward(p.floats[0], p.indices, kRows, vocab);
          compute.vocab_parallel_cross_entropy_backward(p.floats[0], p.indices, kRows, 0, vocab,
                                                        0.5f);
        });
  compare_losses("cross-entropy");
  check(
      "vocabulary-parallel cross-entropy's steps", gpu,
      {{values(kRows * size, 2, 0.0f, 3.0f), values(kRows, 3), values(2 * kRows, 4)}, targets, {}},
      [&](Compute& compute, const Pointers& p) {
        compute.vocab_parallel_row_max(p.floats[1], p.floats[0], kRows, size);
        compute.vocab_parallel_exponentials(p.floats[0], p.floats[2], p.floats[1], p.indices, kRows,
                                            begin, size);
        loss_of(compute) = compute.vocab_parallel_probabilities(p.floats[0], p.floats[2],
                                                                p.floats[1], kRows, size);
        compute.vocab_parallel_cross_entropy_backward(p.floats[0], p.indices, kRows, begin, size,
                                                      0.5f);
      });
  compare_losses("vocabulary-parallel cross-entropy");
}

void check_rotation(Compute& gpu) {
  constexpr int64_t batch = 2, seq_len = 10, head_dim = 16, heads = 3, stride = 5 * head_dim;
  std::vector<int64_t> positions(seq_len);
  for (int64_t t = 0; t < seq_len; ++t) positions[size_t(t)] = 3 * t + 1;
  for (const int64_t rotary_dim : {int64_t(0), int64_t(8)}) {
    const kernels::RotaryTable<float> table(head_dim, positions, 10000.0, rotary_dim);
    const auto host = meshrun::models::host_compute().rotation(table);
    const auto device = gpu.rotation(table);
    check("rotary, rotary_dim " + std::to_string(rotary_dim), gpu,
          {{values(batch * seq_len * stride, 1), values(batch * seq_len * stride, 2)}, {}, {}},
          [&](Compute& compute, const Pointers& p) {
            const auto& rotation = &compute == &gpu ? *device : *host;
            rotation.forward(p.floats[0], batch, seq_len, heads, stride);
            rotation.backward(p.floats[1], batch, seq_len, heads, stride);
          });
  }
}

// What a mixture's steps compute (common/experts.hpp), on host vectors or
// device copies: the router's softmax, routing, slot order, dispatch,
// combine, their backwards, the probabilities' column sums and the router
// gradient. Run by the host's compute on `host` and the GPU's on `device`.
struct MixtureRun {
  static constexpr int64_t kExperts = 8, kTopK = 2, kHidden = 48;
  std::vector<float> probs = values(kRows * kExperts, 1), weights = values(kRows * kTopK, 2),
                     slots = values(kRows * kTopK * kHidden, 3), x = values(kRows * kHidden, 4),
                     y = values(kRows * kHidden, 5), dy = values(kRows * kHidden, 6),
                     expert_outputs = values(kRows * kTopK * kHidden, 7),
                     d_slots = values(kRows * kTopK * kHidden, 8),
                     d_weights = values(kRows * kTopK, 9), dx = values(kRows * kHidden, 10),
                     d_probs = values(kRows * kExperts, 11), aux = values(kExperts, 12);
  std::vector<int32_t> selected = std::vector<int32_t>(kRows * kTopK);
  std::vector<int64_t> slot_position = std::vector<int64_t>(kRows * kTopK);
  std::vector<int64_t> tokens = std::vector<int64_t>(kExperts);
  std::vector<double> sums = std::vector<double>(kExperts);

  void on(Compute& compute, float* const* f, int32_t* chosen, int64_t* positions) {
    compute.softmax_rows(f[0], kRows, kExperts);
    compute.moe_route(chosen, f[1], f[0], kRows, kExperts, kTopK);
    compute.moe_order_slots(tokens.data(), positions, chosen, kRows, kExperts, kTopK);
    compute.moe_dispatch(f[2], f[3], positions, kRows, kTopK, kHidden);
    compute.moe_combine(f[4], f[6], f[1], positions, kRows, kTopK, kHidden);
    compute.moe_combine_backward(f[7], f[8], f[5], f[6], f[1], positions, kRows, kTopK, kHidden);
    compute.moe_dispatch_backward(f[9], f[7], positions, kRows, kTopK, kHidden);
    compute.column_sums(sums.data(), f[0], kRows, kExperts);
    compute.moe_router_gradient(f[10], aux.data(), f[0], chosen, f[1], f[8], kRows, kExperts,
                                kTopK);
    compute.softmax_rows_backward(f[10], f[0], kRows, kExperts);
  }
  std::vector<std::vector<float>*> floats() {
    return {&probs,          &weights, &slots,     &x,  &y,      &dy,
            &expert_outputs, &d_slots, &d_weights, &dx, &d_probs};
  }
};

void check_experts(Compute& gpu) {
  MixtureRun host, device;
  std::vector<float*> host_floats;
  for (auto* buffer : host.floats()) host_floats.push_back(buffer->data());
  host.on(meshrun::models::host_compute(), host_floats.data(), host.selected.data(),
          host.slot_position.data());
  std::vector<std::unique_ptr<DeviceBuffer<float>>> on_device;
  std::vector<float*> device_floats;
  for (auto* buffer : device.floats()) {
    on_device.push_back(std::make_unique<DeviceBuffer<float>>(*buffer));
    device_floats.push_back(on_device.back()->get());
  }
  DeviceBuffer<int32_t> selected(device.selected);
  DeviceBuffer<int64_t> slot_position(device.slot_position);
  device.on(gpu, device_floats.data(), selected.get(), slot_position.get());
  const std::vector<std::vector<float>*> expected = host.floats();
  for (size_t k = 0; k < on_device.size(); ++k) {
    compare("mixture of experts' steps", k, on_device[k]->host(), *expected[k]);
  }
  const bool same_order = selected.host() == host.selected &&
                          slot_position.host() == host.slot_position &&
                          device.tokens == host.tokens;
  std::printf(
      "%s mixture of experts: the experts chosen, the slots' order and the tokens per "
      "expert exactly\n",
      same_order ? "PASS" : "FAIL");
  if (!same_order) ++failures;
  std::vector<float> sums_gpu(device.sums.begin(), device.sums.end()),
      sums_cpu(host.sums.begin(), host.sums.end());
  compare("mixture of experts: the router probabilities' column sums", 0, sums_gpu, sums_cpu);
}

}  // namespace

int main() {
  if (!usable_cuda_devices()) return kSkip;
  cudaStream_t stream = nullptr;
  require(cudaStreamCreate(&stream), "cudaStreamCreate");
  {
    const auto gpu = meshrun::models::make_cuda_compute(0, stream);
    check_linears(*gpu);
    check_vectors(*gpu);
    check_norms(*gpu);
    check_activations(*gpu);
    check_embedding(*gpu);
    check_rotation(*gpu);
    check_attention(*gpu);
    check_ring_attention(*gpu);
    check_cross_entropy(*gpu);
    check_experts(*gpu);
  }
  cudaStreamDestroy(stream);
  std::printf("%d of the GPU compute's checks failed\n", failures);
  return failures == 0 ? 0 : 1;
}
