// The pieces of the Llama decoder a stage (stage.hpp) is made of: the
// forward and backward of a decoder layer and of the head (final norm,
// lm_head, loss) over explicit parameter views, with what each keeps for its
// backward. Internal to the model library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/layers.hpp"
#include "common/support.hpp"
#include "llama/model.hpp"

namespace meshrun::llama {

using kernels::AttentionShape;
using kernels::RotaryTable;

// Throws std::invalid_argument("llama: " + message) unless condition.
void require(bool condition, const std::string& message);

using models::bytes_of;
using models::check_tokens;
using models::use_one_blas_thread_by_default;

// A decoder layer's tensors, in buffer order. q, k, v are adjacent, so they
// act as one fused [q+2kv, H] projection; gate and up likewise as one [2I, H].
enum LayerTensor { kInputNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown, kTensorsPerLayer };

// What every layer of a pass at one (batch, seq_len) shares: the sizes, the
// rotary table, and scratch that holds nothing from one layer to the next.
// N = batch * seq_len rows throughout.
struct DecoderPass {
  DecoderPass(const LlamaConfig& config, int64_t batch, int64_t seq_len);
  int64_t rows() const { return attention.batch * attention.seq_len; }

  AttentionShape attention;
  int64_t hidden, intermediate, vocab;
  double eps;
  RotaryTable<float> rotary;
  std::vector<float> projection;  // o_proj / down_proj output before its residual add
  // The residual stream's gradient [N, H], from a layer's output to its input.
  std::vector<float> d_residual;
  std::vector<float> d_norm, d_qkv, d_attention, d_scores, d_gate_up, d_mlp;
};

// What one decoder layer's forward keeps for its backward.
struct LayerActivations {
  explicit LayerActivations(const DecoderPass& pass);
  int64_t bytes() const;

  std::vector<float> norm1, rstd1;  // rmsnorm(x) [N, H], its 1/rms [N]
  std::vector<float> qkv;           // after rotary [N, q+2kv]
  std::vector<float> probs;         // [batch, heads, T, T]
  std::vector<float> attention;     // attention output [N, q]
  std::vector<float> h;             // x + o_proj(attention) [N, H]
  std::vector<float> norm2, rstd2;  // rmsnorm(h) [N, H], [N]
  std::vector<float> gate_up;       // [N, 2I]
  std::vector<float> mlp;           // silu(gate) * up [N, I]
};

// What the head's forward keeps.
struct HeadActivations {
  explicit HeadActivations(const DecoderPass& pass);
  int64_t bytes() const;

  std::vector<float> final_norm, final_rstd;  // [N, H], [N]
  std::vector<float> logits;  // softmax after forward, the loss gradient in backward [N, V]
};

// Where a backward sends the weight gradients it owes, so that one backward
// serves a full backward (computed at once, announced to hooks) and a
// pipeline's input-only backward (kept for a later weight pass).
class WeightGradients {
 public:
  virtual ~WeightGradients() = default;
  // dW += dy^T x for the linear whose weight spans the adjacent views
  // [first, last] (q/k/v and gate/up are fused). dy is [rows, out] scratch,
  // valid during the call. This is x's last use in the backward, so the
  // receiver may move it away.
  virtual void linear(const ParameterView* first, const ParameterView* last, const float* dy,
                      std::vector<float>& x, int64_t rows, int64_t in, int64_t out) = 0;
  // The gradient of a norm weight, computed along the input gradient (it is
  // cheap), is final.
  virtual void norm_ready(const ParameterView& view) = 0;
};

// Computes each linear's weight gradient when it is owed; announces every
// gradient through ready(), last view first.
class ImmediateWeightGradients : public WeightGradients {
 public:
  void linear(const ParameterView* first, const ParameterView* last, const float* dy,
              std::vector<float>& x, int64_t rows, int64_t in, int64_t out) override;
  void norm_ready(const ParameterView& view) override { ready(view); }

 protected:
  virtual void ready(const ParameterView& /*view*/) {}
};

// h = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)))))
// out = h + down_proj(swiglu(gate_up_proj(rmsnorm(h))))
// `layer` points at the layer's first view; the others follow in LayerTensor
// order.
void layer_forward(DecoderPass& pass, const ParameterView* layer, const float* x,
                   LayerActivations& saved, float* out);
// On entry pass.d_residual holds dL/d(out); on exit dL/dx. x is the layer's
// input, as in its forward.
void layer_backward(DecoderPass& pass, const ParameterView* layer, const float* x,
                    LayerActivations& saved, WeightGradients& gradients);

// The mean cross-entropy of lm_head(rmsnorm(x)) against targets.
double head_forward(DecoderPass& pass, const ParameterView& norm, const ParameterView& lm_head,
                    const float* x, const int32_t* targets, HeadActivations& saved);
// Overwrites pass.d_residual with d(loss_scale * loss)/dx.
void head_backward(DecoderPass& pass, const ParameterView& norm, const ParameterView& lm_head,
                   const float* x, const int32_t* targets, float loss_scale, HeadActivations& saved,
                   WeightGradients& gradients);

}  // namespace meshrun::llama
