// The compute of a kit-composed model: the family of
// models::TransformerStage (common/stage.hpp) whose decoder layer is the
// composition's list of ops, run forward in order and backward in reverse.
// A tensor's gradient is one [rows, hidden] buffer: an ADD hands its own to
// its first addend and a copy to its second, the others sum into it, and an
// attention's or MLP's input gradient is summed over tp before it joins.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/context_parallel.hpp"
#include "common/layers.hpp"
#include "common/mixture_of_experts.hpp"
#include "common/stage.hpp"
#include "kit/composition.hpp"

namespace meshrun::kit {

using models::Block;
using models::TensorParallelGroup;
using models::WeightGradients;
using Floats = models::Buffer<float>;

// What every layer of a pass at one (batch, seq_len) shares: the sizes
// (of one tp rank for a parallel block), the rotary table, scratch, and the
// gradient buffers a backward passes between tensors, the experts' scratch.
struct Pass {
  Pass(const Composition& c, int64_t batch, int64_t seq_len, TensorParallelGroup& tp,
       bool sequence_parallel, const models::ParallelBlocks& blocks,
       const models::ContextParallel& cp, const models::ExpertParallel& ep,
       models::Compute& compute);
  int64_t rows() const { return attention.batch * attention.seq_len; }
  // With sequence parallelism the residual stream between the attention
  // and MLP blocks (every tensor but their inputs) holds the rank's rows
  // only (common/tensor_parallel.hpp).
  int64_t stream_rows() const { return sequence_parallel ? rows() / tp.size() : rows(); }
  int64_t stream_numel() const { return stream_rows() * hidden; }
  // The elements of a tensor that op `writer` writes.
  int64_t numel_of(const LayerOp& writer) const {
    return sequence_parallel && writer.gathered_output ? rows() * hidden : stream_numel();
  }
  TensorParallelGroup& group(Block block) { return blocks.group(block, tp, replicated); }
  // A [rows, hidden] buffer, of undefined contents or zeroed; and back.
  Floats take();
  Floats take_zeroed();
  void give(Floats&& buffer);

  const Composition& composition;
  // Where the layer's kernels run and its buffers are (common/compute.hpp).
  models::Compute& compute;
  TensorParallelGroup& tp;
  models::ReplicatedOver replicated;
  models::ParallelBlocks blocks;
  bool sequence_parallel;
  kernels::AttentionShape attention;
  int64_t hidden, intermediate;
  models::VocabShard embedding_vocab, head_vocab;
  models::SequenceAttention attend;  // over the cp ranks, with its scratch
  // Of the rows' positions in their sequence: rotary's angles (where the
  // compute reads them), or the learned position table's rows [rows].
  kernels::RotaryTable<float> rotary;
  std::unique_ptr<models::Rotation> rotation;
  models::Buffer<int32_t> positions{compute};
  // Per tensor, the outputs no backward reads (an ADD's addends, and the
  // layer's output as selective recomputation writes it): scratch.
  std::vector<Floats> transient;
  // The residual stream's gradient [rows, hidden], as the stage hands it.
  Floats d_residual{compute};
  Floats d_qkv, d_attention, d_hidden, d_act;
  Floats d_norm;  // the final norm's output gradient [rows, hidden]
  // Sequence parallelism's scratch: a norm's rows before they are gathered,
  // a row-parallel output before it is reduce-scattered and a projection's
  // input gradient before it is [rows, hidden]; a gathered gradient
  // [rows, hidden]; a norm's weight and bias gradients before their sum
  // over tp [hidden].
  Floats stream{compute}, projection{compute}, d_gathered{compute}, d_norm_weight{compute},
      d_norm_bias{compute};
  std::vector<Floats> spare;  // take()'s buffers
  // The mixtures' (MOE_MLP ops'), when the layer has one; the first view of
  // each op among the layer's views the rank holds.
  std::unique_ptr<models::MixtureScratch> experts;
  std::vector<int64_t> first_view;
  float loss_scale = 1.0f;            // d objective / d loss of the backward running now
  bool bfloat16_activations = false;  // common/stage.hpp
};

// What an op's forward keeps for its backward: a norm's 1/rms or 1/std
// (and mean); attention's q/k/v after rotary, log-sum-exps and output; an
// MLP's input projection and activation; a mixture's routing and experts'.
struct OpActivations {
  explicit OpActivations(models::Compute& compute)
      : rstd(compute),
        mean(compute),
        qkv(compute),
        lse(compute),
        attention(compute),
        hidden(compute),
        act(compute) {}
  Floats rstd, mean, qkv, lse, attention, hidden, act;
  std::optional<models::MixtureActivations> experts;
};

struct LayerActivations {
  explicit LayerActivations(const Pass& pass);
  int64_t bytes() const;

  const Composition* composition;
  std::vector<Floats> tensors;  // the kept outputs [rows, hidden], by tensor
  std::vector<OpActivations> ops;
};

struct HeadActivations {
  explicit HeadActivations(const Pass& pass);
  int64_t bytes() const;

  // [N, H] (gathered with sequence parallelism), [n], [n] (LayerNorm) with
  // n the stream's rows
  Floats norm, rstd, mean;
  Floats logits;  // softmax after forward, the loss gradient in backward [N, V]
};

struct Composed {
  using Config = Composition;
  using Pass = kit::Pass;
  using LayerActivations = kit::LayerActivations;
  using HeadActivations = kit::HeadActivations;
  static constexpr const char* kName = "kit";
  static int64_t embedding_tensors(const Config& config) { return config.embedding_views(); }
  static constexpr bool kSequenceParallel = true;
  // A composition may have MOE_MLP ops: a stage hands the pass its ep
  // group and reports router statistics (none without a mixture).
  static constexpr bool kExperts = true;
  // It computes on any device's compute, its buffers in that memory.
  static constexpr bool kAnyCompute = true;

  static void check_config(const Config& /*config*/) {}
  static int64_t num_layers(const Config& config) { return config.num_hidden_layers; }
  static std::vector<ParameterView> parameters(const Config& config) {
    return kit::parameters(config);
  }
  static void init_parameter(const Config& config, const std::vector<ParameterView>& parameters,
                             uint64_t seed, int64_t index, float* values) {
    kit::init_parameter(config, parameters, seed, index, values);
  }
  // Throws std::invalid_argument unless each fused projection's weights
  // (q/k/v, gate/up, an expert's w1/w3) and biases lie one after another in
  // the host's storage.
  static void check_layer_storage(std::span<const ParameterView> layer, bool backward);
  static void check_tensor_parallel(const Config& config, int64_t tp,
                                    const models::ParallelBlocks& blocks) {
    kit::check_tensor_parallel(config, tp, blocks);
  }
  static std::optional<Block> tensor_parallel_block(const Config& config,
                                                    const std::string& parameter) {
    return kit::tensor_parallel_block(config, parameter);
  }

  static void embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                                float* out);
  static void embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens);
  static void layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                            LayerActivations& saved, float* out);
  static void layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, WeightGradients& gradients);
  // The norms' outputs and statistics and the MLPs' activations.
  static std::vector<Floats*> elementwise(LayerActivations& saved);
  // What a bfloat16 run keeps in bfloat16: all but the norms' statistics,
  // the log-sum-exps, the router's and the loss's probabilities.
  static models::LowPrecisionBuffers low_precision(LayerActivations& saved);
  static models::LowPrecisionBuffers low_precision(HeadActivations& saved) { return {&saved.norm}; }
  static void recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                    LayerActivations& saved);
  static double head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                             const float* x, const int32_t* targets, HeadActivations& saved);
  static void head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                            const float* x, const int32_t* targets, float loss_scale,
                            HeadActivations& saved, WeightGradients& gradients);
};

}  // namespace meshrun::kit

extern template class meshrun::models::TransformerStage<meshrun::kit::Composed>;
