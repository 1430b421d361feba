// The Mixtral family of models::TransformerStage (common/stage.hpp): Llama's
// embedding, attention half and head (llama/decoder.hpp), and the sparse
// mixture-of-experts block in place of the MLP, its experts over the
// stage's ep ranks (common/expert_parallel.hpp). Internal to the model
// library.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/expert_parallel.hpp"
#include "common/mixture_of_experts.hpp"
#include "llama/decoder.hpp"
#include "mixtral/model.hpp"

namespace meshrun::mixtral {

using models::WeightGradients;

// A layer's views: Llama's attention half (llama::LayerTensor kInputNorm
// to kO), then the post-attention norm, then the mixture's: the router and
// w1, w3, w2 of each expert the rank holds (common/mixture_of_experts.hpp).
enum MoeTensor { kPostNorm = llama::kPostNorm, kRouter };

// What every layer of a pass shares: Llama's pass and the mixture's scratch
// (N = rows() tokens).
struct MoePass : llama::DecoderPass {
  MoePass(const MixtralConfig& config, int64_t batch, int64_t seq_len,
          models::TensorParallelGroup& tp, bool sequence_parallel,
          const models::ParallelBlocks& blocks, const models::ContextParallel& cp,
          const models::ExpertParallel& ep);

  models::MixtureScratch experts;
  models::Buffer<float> moe_out;  // the mixture's output [N, H], before its residual add
  float loss_scale = 1.0f;        // d objective / d loss of the backward running now
};

// What one layer's forward keeps for its backward.
struct MoeActivations : llama::AttentionActivations {
  explicit MoeActivations(const MoePass& pass);
  int64_t bytes() const;

  models::Buffer<float> norm2, rstd2;  // rmsnorm(h) [N, H], [N]
  models::MixtureActivations experts;
};

struct Mixtral {
  using Config = MixtralConfig;
  using Pass = MoePass;
  using LayerActivations = MoeActivations;
  using HeadActivations = llama::HeadActivations;
  static constexpr const char* kName = "mixtral";
  static int64_t embedding_tensors(const Config& /*config*/) { return 1; }
  static constexpr bool kSequenceParallel = false;
  static constexpr bool kExperts = true;

  static void check_config(const Config& config) { mixtral::check_config(config); }
  static int64_t num_layers(const Config& config) { return config.num_hidden_layers; }
  static std::vector<ParameterView> parameters(const Config& config) {
    return model_parameters(config);
  }
  static void init_parameter(const Config& /*config*/, const std::vector<ParameterView>& parameters,
                             uint64_t seed, int64_t index, float* values) {
    mixtral::init_parameter(parameters, seed, index, values);
  }
  static void check_layer_storage(std::span<const ParameterView> layer, bool backward);
  // Experts compute whole on every rank: tp > 1 is refused.
  static void check_tensor_parallel(const Config& config, int64_t tp,
                                    const models::ParallelBlocks& blocks);
  static std::optional<models::Block> tensor_parallel_block(const Config& /*config*/,
                                                            const std::string& /*parameter*/) {
    return std::nullopt;
  }

  static void embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                                float* out) {
    llama::Llama::embedding_forward(pass, embedding, tokens, out);
  }
  static void embedding_backward(Pass& pass, const ParameterView* embedding,
                                 const int32_t* tokens) {
    llama::Llama::embedding_backward(pass, embedding, tokens);
  }
  // h = x + attention half (Llama's); out = h + mixture(rmsnorm(h))
  // (common/mixture_of_experts.hpp).
  static void layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                            LayerActivations& saved, float* out);
  // pass.d_residual from dL/d(out) to dL/dx, with the load-balancing
  // loss's gradient (router_aux_loss_coef / layers * its gradient) through
  // the router; adds the layer's statistics.
  static void layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, WeightGradients& gradients);
  // The norms: what selective checkpointing recomputes.
  static std::vector<models::Buffer<float>*> elementwise(LayerActivations& saved) {
    return {&saved.norm1, &saved.rstd1, &saved.norm2, &saved.rstd2};
  }
  // What a bfloat16 run keeps in bfloat16: all but the norms' 1/rms, the
  // log-sum-exps, the router's and the loss's probabilities.
  static models::LowPrecisionBuffers low_precision(LayerActivations& saved) {
    models::LowPrecisionBuffers buffers{&saved.norm1, &saved.qkv, &saved.attention, &saved.h,
                                        &saved.norm2};
    for (models::Buffer<float>* buffer : models::low_precision(saved.experts)) {
      buffers.push_back(buffer);
    }
    return buffers;
  }
  static models::LowPrecisionBuffers low_precision(HeadActivations& saved) {
    return {&saved.final_norm};
  }
  static void recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                    LayerActivations& saved);
  static double head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                             const float* x, const int32_t* targets, HeadActivations& saved) {
    return llama::Llama::head_forward(pass, head, lm_head, x, targets, saved);
  }
  static void head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                            const float* x, const int32_t* targets, float loss_scale,
                            HeadActivations& saved, WeightGradients& gradients) {
    llama::Llama::head_backward(pass, head, lm_head, x, targets, loss_scale, saved, gradients);
  }
};

}  // namespace meshrun::mixtral
