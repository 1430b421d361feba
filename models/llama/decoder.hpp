// The pieces of the Llama decoder a stage (stage.hpp) is made of: the
// forward and backward of the embedding, a decoder layer and the head
// (final norm, lm_head, loss) over explicit parameter views, with what each
// keeps for its backward, as the family models::TransformerStage computes
// (common/stage.hpp). Internal to the model library.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/layers.hpp"
#include "common/stage.hpp"
#include "llama/model.hpp"

namespace meshrun::llama {

using kernels::AttentionShape;
using kernels::RotaryTable;
using models::TensorParallelGroup;
using models::VocabShard;
using models::WeightGradients;

// A decoder layer's tensors, in buffer order. q, k, v are adjacent, so they
// act as one fused [q+2kv, H] projection; gate and up likewise as one [2I, H].
enum LayerTensor { kInputNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown, kTensorsPerLayer };

// What every layer of a pass at one (batch, seq_len) shares: the sizes, the
// rotary table, and scratch that holds nothing from one layer to the next.
// N = batch * seq_len rows throughout. Over a tp group the sizes of a
// parallel block are one rank's: heads, key/value heads and intermediate /
// tp, its vocabulary shard; a replicated block's are whole.
// With sequence parallelism the residual stream between the blocks (a
// layer's input and output, h, and the norms' 1/rms) holds the rank's
// stream_rows() = N / tp rows only (common/tensor_parallel.hpp).
struct DecoderPass {
  DecoderPass(const LlamaConfig& config, int64_t batch, int64_t seq_len, TensorParallelGroup& tp,
              bool sequence_parallel, const models::ParallelBlocks& blocks,
              const models::ContextParallel& cp);
  int64_t rows() const { return attention.batch * attention.seq_len; }
  int64_t stream_rows() const { return sequence_parallel ? rows() / tp.size() : rows(); }
  int64_t stream_numel() const { return stream_rows() * hidden; }
  // What a block's partial sums are summed over: tp, or nothing when the
  // block is replicated.
  TensorParallelGroup& group(models::Block block) { return blocks.group(block, tp, replicated); }

  TensorParallelGroup& tp;
  models::ReplicatedOver replicated;
  models::ParallelBlocks blocks;
  bool sequence_parallel;
  AttentionShape attention;
  int64_t hidden, intermediate;
  VocabShard embedding_vocab, head_vocab;
  double eps;
  models::SequenceAttention attend;   // over the cp ranks, with its scratch
  RotaryTable<float> rotary;          // of the rows' positions in their sequence
  models::Buffer<float> projection;   // o_proj / down_proj output before its residual add
  bool bfloat16_activations = false;  // common/stage.hpp
  // The residual stream's gradient [N, H], from a layer's output to its input.
  models::Buffer<float> d_residual;
  models::Buffer<float> d_norm, d_qkv, d_attention, d_gate_up, d_mlp;
  // Sequence parallelism's scratch: the rank's rows of a norm's output or
  // of a reduce-scattered sum [n, H], a gathered gradient [N, H], and a
  // norm weight's gradient before its sum over tp [H].
  models::Buffer<float> stream, d_gathered, d_norm_weight;
};

// What a decoder layer's attention half keeps for its backward.
struct AttentionActivations {
  explicit AttentionActivations(const DecoderPass& pass);
  int64_t bytes() const;

  models::Buffer<float> norm1, rstd1;  // rmsnorm(x) [N, H], its 1/rms [N]
  models::Buffer<float> qkv;           // after rotary [N, q+2kv]
  models::Buffer<float> lse;           // attention's log-sum-exps [batch, heads, T]
  models::Buffer<float> attention;     // attention output [N, q]
  models::Buffer<float> h;             // x + o_proj(attention) [N, H]
};

// What one decoder layer's forward keeps for its backward.
struct LayerActivations : AttentionActivations {
  explicit LayerActivations(const DecoderPass& pass);
  int64_t bytes() const;

  models::Buffer<float> norm2, rstd2;  // rmsnorm(h) [N, H], [N]
  models::Buffer<float> gate_up;       // [N, 2I]
  models::Buffer<float> mlp;           // silu(gate) * up [N, I]
};

// The attention half of a decoder layer, which a layer's first views
// (LayerTensor kInputNorm to kO) compute and the mixture-of-experts family
// shares: saved.h = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x))))).
void attention_forward(DecoderPass& pass, const ParameterView* layer, const float* x,
                       AttentionActivations& saved);
// Its norm again (saved.norm1, rstd1), as attention_forward computes it:
// what selective checkpointing recomputes.
void attention_norm(DecoderPass& pass, const ParameterView* layer, const float* x,
                    AttentionActivations& saved);
// On entry pass.d_residual holds dL/dh; on exit dL/dx.
void attention_backward(DecoderPass& pass, const ParameterView* layer, const float* x,
                        AttentionActivations& saved, WeightGradients& gradients);
// Throws std::invalid_argument unless q, k, v are adjacent in the host's
// storage (they act as one fused projection).
void check_attention_storage(const ParameterView* layer, bool backward);

// What the head's forward keeps.
struct HeadActivations {
  explicit HeadActivations(const DecoderPass& pass);
  int64_t bytes() const;

  models::Buffer<float> final_norm, final_rstd;  // [N, H], [N]
  models::Buffer<float> logits;  // softmax after forward, the loss gradient in backward [N, V]
};

// The Llama family of models::TransformerStage.
struct Llama {
  using Config = LlamaConfig;
  using Pass = DecoderPass;
  using LayerActivations = llama::LayerActivations;
  using HeadActivations = llama::HeadActivations;
  static constexpr const char* kName = "llama";
  static int64_t embedding_tensors(const Config& /*config*/) { return 1; }

  static void check_config(const Config& config) { llama::check_config(config); }
  static int64_t num_layers(const Config& config) { return config.num_hidden_layers; }
  static std::vector<ParameterView> parameters(const Config& config) {
    return model_parameters(config);
  }
  static void init_parameter(const Config& /*config*/, const std::vector<ParameterView>& parameters,
                             uint64_t seed, int64_t index, float* values) {
    llama::init_parameter(parameters, seed, index, values);
  }
  // Throws std::invalid_argument unless q, k, v and gate, up are adjacent.
  static void check_layer_storage(std::span<const ParameterView> layer, bool backward);
  static void check_tensor_parallel(const Config& config, int64_t tp,
                                    const models::ParallelBlocks& blocks) {
    llama::check_tensor_parallel(config, tp, blocks);
  }
  static std::optional<models::Block> tensor_parallel_block(const Config& /*config*/,
                                                            const std::string& parameter) {
    return llama::tensor_parallel_block(parameter);
  }
  static constexpr bool kSequenceParallel = true;

  // out = embed_tokens[tokens]
  static void embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                                float* out);
  static void embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens);
  // h = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)))))
  // out = h + down_proj(swiglu(gate_up_proj(rmsnorm(h))))
  // Over tp: qkv and gate_up column-parallel (the rank's heads and
  // intermediate columns), o and down row-parallel, summed over the group.
  // `layer` points at the layer's first view; the others follow in
  // LayerTensor order.
  static void layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                            LayerActivations& saved, float* out);
  // On entry pass.d_residual holds dL/d(out); on exit dL/dx. x is the
  // layer's input, as in its forward.
  static void layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, WeightGradients& gradients);
  // The norms and swiglu: what selective checkpointing recomputes.
  static std::vector<models::Buffer<float>*> elementwise(LayerActivations& saved) {
    return {&saved.norm1, &saved.rstd1, &saved.norm2, &saved.rstd2, &saved.mlp};
  }
  // What a bfloat16 run keeps in bfloat16: all but the norms' 1/rms, the
  // log-sum-exps and the loss's softmax.
  static models::LowPrecisionBuffers low_precision(LayerActivations& saved) {
    return {&saved.norm1, &saved.qkv,     &saved.attention, &saved.h,
            &saved.norm2, &saved.gate_up, &saved.mlp};
  }
  static models::LowPrecisionBuffers low_precision(HeadActivations& saved) {
    return {&saved.final_norm};
  }
  static void recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                    LayerActivations& saved);
  // The mean cross-entropy of lm_head(rmsnorm(x)) against targets; `head`
  // is model.norm's view.
  static double head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                             const float* x, const int32_t* targets, HeadActivations& saved);
  // Overwrites pass.d_residual with d(loss_scale * loss)/dx.
  static void head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                            const float* x, const int32_t* targets, float loss_scale,
                            HeadActivations& saved, WeightGradients& gradients);
};

}  // namespace meshrun::llama
