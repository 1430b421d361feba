// A stage of the GPT-2 model (common/stage.hpp): a contiguous range of
// blocks, with the embeddings (wte, wpe) on the first stage and ln_f,
// lm_head and the loss on the last; the whole model is the stage that holds
// everything. Its parameters in the stage's order: transformer.wte.weight,
// transformer.wpe.weight (embedding); the blocks' tensors;
// transformer.ln_f.{weight, bias} and lm_head.weight unless tied (head).
// The pieces below are what the stage is made of: the forward and backward
// of the embeddings, a block and the head over explicit parameter views,
// with what each keeps for its backward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/layers.hpp"
#include "common/stage.hpp"
#include "gpt2/model.hpp"

namespace meshrun::gpt2 {

using kernels::AttentionShape;
using models::StageHooks;
using models::StageLayout;
using models::WeightGradients;

// A block's tensors, in parameter order: each bias follows its weight.
enum BlockTensor {
  kLn1Weight,
  kLn1Bias,
  kAttnWeight,
  kAttnBias,
  kAttnProjWeight,
  kAttnProjBias,
  kLn2Weight,
  kLn2Bias,
  kFcWeight,
  kFcBias,
  kMlpProjWeight,
  kMlpProjBias,
  kTensorsPerBlock
};

// What every block of a pass at one (batch, seq_len) shares: the sizes and
// scratch that holds nothing from one block to the next. N = batch *
// seq_len rows throughout. Over a tp group the sizes of a parallel block
// are one rank's: heads and inner / tp, its vocabulary shard; a replicated
// block's are whole.
struct BlockPass {
  // Throws std::invalid_argument for seq_len beyond n_positions: wpe has a
  // row per position.
  // Sequence parallelism is refused before (Gpt2::kSequenceParallel).
  BlockPass(const Gpt2Config& config, int64_t batch, int64_t seq_len,
            models::TensorParallelGroup& tp, bool sequence_parallel,
            const models::ParallelBlocks& blocks, const models::ContextParallel& cp);
  int64_t rows() const { return attention.batch * attention.seq_len; }
  int64_t stream_numel() const { return rows() * hidden; }
  // What a block's partial sums are summed over: tp, or nothing when the
  // block is replicated.
  models::TensorParallelGroup& group(models::Block block) {
    return blocks.group(block, tp, replicated);
  }

  models::TensorParallelGroup& tp;
  models::ReplicatedOver replicated;
  models::ParallelBlocks blocks;
  AttentionShape attention;  // multi-head: kv_heads = heads
  int64_t hidden, inner;
  models::VocabShard embedding_vocab, head_vocab;
  double eps;
  std::vector<int32_t> positions;  // [N]: row b * T + t's in its sequence
  // A c_proj's output before its residual add; the position embeddings.
  models::Buffer<float> projection;
  // The residual stream's gradient [N, E], from a block's output to its input.
  models::Buffer<float> d_residual;
  models::SequenceAttention attend;  // over the cp ranks, with its scratch
  models::Buffer<float> d_norm, d_qkv, d_attention, d_mlp;
  bool bfloat16_activations = false;  // common/stage.hpp
};

// What one block's forward keeps for its backward.
struct BlockActivations {
  explicit BlockActivations(const BlockPass& pass);
  int64_t bytes() const;

  models::Buffer<float> ln1, mean1, rstd1;  // ln_1(x) [N, E], its mean and 1/std [N]
  models::Buffer<float> qkv;                // c_attn output [N, 3E]
  models::Buffer<float> lse;                // attention's log-sum-exps [batch, heads, T]
  models::Buffer<float> attention;          // attention output [N, E]
  models::Buffer<float> h;                  // x + attn.c_proj(attention) [N, E]
  models::Buffer<float> ln2, mean2, rstd2;  // ln_2(h) [N, E], [N], [N]
  models::Buffer<float> fc;                 // c_fc output [N, I]
  models::Buffer<float> act;                // gelu_new(fc) [N, I]
};

// What the head's forward keeps.
struct HeadActivations {
  explicit HeadActivations(const BlockPass& pass);
  int64_t bytes() const;

  models::Buffer<float> final_norm, final_mean, final_rstd;  // [N, E], [N], [N]
  models::Buffer<float> logits;  // softmax after forward, the loss gradient in backward [N, V]
};

// The GPT-2 family of models::TransformerStage.
struct Gpt2 {
  using Config = Gpt2Config;
  using Pass = BlockPass;
  using LayerActivations = BlockActivations;
  using HeadActivations = gpt2::HeadActivations;
  static constexpr const char* kName = "gpt2";
  static int64_t embedding_tensors(const Config& /*config*/) { return 2; }

  static void check_config(const Config& config) { gpt2::check_config(config); }
  static int64_t num_layers(const Config& config) { return config.n_layer; }
  static std::vector<ParameterView> parameters(const Config& config) {
    return model_parameters(config);
  }
  static constexpr auto init_parameter = &gpt2::init_parameter;
  // Each of a block's tensors is used alone: any storage will do.
  static void check_layer_storage(std::span<const ParameterView> /*layer*/, bool /*backward*/) {}
  static void check_tensor_parallel(const Config& config, int64_t tp,
                                    const models::ParallelBlocks& blocks) {
    gpt2::check_tensor_parallel(config, tp, blocks);
  }
  static std::optional<models::Block> tensor_parallel_block(const Config& /*config*/,
                                                            const std::string& parameter) {
    return gpt2::tensor_parallel_block(parameter);
  }
  // The residual stream stays replicated over tp ranks.
  static constexpr bool kSequenceParallel = false;

  // out = wte[tokens] + wpe[positions]; `embedding` points at wte, wpe.
  static void embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                                float* out);
  static void embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens);
  // h = x + attn.c_proj(attention(attn.c_attn(ln_1(x))))
  // out = h + mlp.c_proj(gelu_new(mlp.c_fc(ln_2(h))))
  // `block` points at the block's first view; the others follow in
  // BlockTensor order.
  static void layer_forward(Pass& pass, const ParameterView* block, const float* x,
                            LayerActivations& saved, float* out);
  // On entry pass.d_residual holds dL/d(out); on exit dL/dx. x is the
  // block's input, as in its forward.
  static void layer_backward(Pass& pass, const ParameterView* block, const float* x,
                             LayerActivations& saved, WeightGradients& gradients);
  // The LayerNorms and gelu_new: what selective checkpointing recomputes.
  static std::vector<models::Buffer<float>*> elementwise(LayerActivations& saved) {
    return {&saved.ln1,   &saved.mean1, &saved.rstd1, &saved.ln2,
            &saved.mean2, &saved.rstd2, &saved.act};
  }
  // What a bfloat16 run keeps in bfloat16: all but the LayerNorms' means
  // and 1/std, the log-sum-exps and the loss's softmax.
  static models::LowPrecisionBuffers low_precision(LayerActivations& saved) {
    return {&saved.ln1, &saved.qkv, &saved.attention, &saved.h, &saved.ln2, &saved.fc, &saved.act};
  }
  static models::LowPrecisionBuffers low_precision(HeadActivations& saved) {
    return {&saved.final_norm};
  }
  static void recompute_elementwise(Pass& pass, const ParameterView* block, const float* x,
                                    LayerActivations& saved);
  // The mean cross-entropy of ln_f(x) lm_head^T against targets; `head`
  // points at ln_f's weight and bias.
  static double head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                             const float* x, const int32_t* targets, HeadActivations& saved);
  // Overwrites pass.d_residual with d(loss_scale * loss)/dx.
  static void head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                            const float* x, const int32_t* targets, float loss_scale,
                            HeadActivations& saved, WeightGradients& gradients);
};

using Gpt2Stage = models::TransformerStage<Gpt2>;

}  // namespace meshrun::gpt2

extern template class meshrun::models::TransformerStage<meshrun::gpt2::Gpt2>;
