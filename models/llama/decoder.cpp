#include "llama/decoder.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/support.hpp"

namespace meshrun::llama {

using namespace kernels;
using models::bytes_of;
using models::WeightLayout;

constexpr WeightLayout kOutIn = WeightLayout::out_in;

namespace {

// The element-wise steps of a layer's forward, out of line: selective
// checkpointing computes them again in the backward, and one copy of the
// code gives the same bits where inlined copies may vectorize differently.
[[gnu::noinline]] void rmsnorm_out_of_line(float* y, float* rstd, const float* x,
                                           const ParameterView& norm, const DecoderPass& pass) {
  rmsnorm_forward(y, rstd, x, norm.data, pass.rows(), pass.hidden, pass.eps);
}
[[gnu::noinline]] void swiglu_out_of_line(float* y, const float* gate_up, const DecoderPass& pass) {
  swiglu_forward(y, gate_up, pass.rows(), pass.intermediate);
}

}  // namespace

DecoderPass::DecoderPass(const LlamaConfig& c, int64_t batch, int64_t seq_len,
                         TensorParallelGroup& tp)
    : tp(tp),
      attention{batch, seq_len, c.num_attention_heads / tp.size(),
                c.num_key_value_heads / tp.size(), c.hidden_size / c.num_attention_heads},
      hidden(c.hidden_size),
      intermediate(c.intermediate_size / tp.size()),
      vocab(models::vocab_shard(c.vocab_size, tp)),
      eps(c.rms_norm_eps),
      rotary(attention.head_dim, seq_len, c.rope_theta),
      projection(rows() * hidden),
      d_residual(rows() * hidden),
      d_norm(rows() * hidden),
      d_qkv(rows() * attention.qkv_dim()),
      d_attention(rows() * attention.q_dim()),
      d_scores(attention.d_scores_size()),
      d_gate_up(rows() * 2 * intermediate),
      d_mlp(rows() * intermediate) {}

LayerActivations::LayerActivations(const DecoderPass& pass)
    : norm1(pass.rows() * pass.hidden),
      rstd1(pass.rows()),
      qkv(pass.rows() * pass.attention.qkv_dim()),
      probs(pass.attention.batch * pass.attention.heads * pass.attention.seq_len *
            pass.attention.seq_len),
      attention(pass.rows() * pass.attention.q_dim()),
      h(pass.rows() * pass.hidden),
      norm2(pass.rows() * pass.hidden),
      rstd2(pass.rows()),
      gate_up(pass.rows() * 2 * pass.intermediate),
      mlp(pass.rows() * pass.intermediate) {}

int64_t LayerActivations::bytes() const {
  return bytes_of(norm1, rstd1, qkv, probs, attention, h, norm2, rstd2, gate_up, mlp);
}

HeadActivations::HeadActivations(const DecoderPass& pass)
    : final_norm(pass.rows() * pass.hidden),
      final_rstd(pass.rows()),
      logits(pass.rows() * pass.vocab.size) {}

int64_t HeadActivations::bytes() const { return bytes_of(final_norm, final_rstd, logits); }

// q, k, v and gate, up act as one fused projection each: the host lays a
// unit's parameters out one after another (meshrun/model.h).
void Llama::check_layer_storage(const ParameterView* layer, bool backward) {
  const auto adjacent = [&](LayerTensor first, LayerTensor last) {
    for (int t = first; t < last; ++t) {
      if (layer[t].data + layer[t].numel != layer[t + 1].data ||
          (backward && layer[t].grad + layer[t].numel != layer[t + 1].grad)) {
        return false;
      }
    }
    return true;
  };
  if (!adjacent(kQ, kV) || !adjacent(kGate, kUp)) {
    throw std::invalid_argument("llama: the host gave " +
                                layer[kQ].name.substr(0, layer[kQ].name.rfind(".self_attn")) +
                                " storage that is not one block in parameter order");
  }
}

void Llama::embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                              float* out) {
  models::vocab_parallel_embedding_forward(out, tokens, embedding->data, pass.rows(), pass.hidden,
                                           pass.vocab, pass.tp);
}

void Llama::embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens) {
  models::vocab_parallel_embedding_backward(embedding->grad, tokens, pass.d_residual.data(),
                                            pass.rows(), pass.hidden, pass.vocab);
}

void Llama::layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                          LayerActivations& saved, float* out) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate;

  rmsnorm_out_of_line(saved.norm1.data(), saved.rstd1.data(), x, layer[kInputNorm], pass);
  linear_forward(saved.qkv.data(), saved.norm1.data(), layer[kQ].data, N, H, shape.qkv_dim());
  rotary_forward(saved.qkv.data(), pass.rotary, shape.batch, shape.seq_len,
                 shape.heads + shape.kv_heads, shape.qkv_dim());
  attention_forward(saved.attention.data(), saved.probs.data(), saved.qkv.data(), shape);
  linear_forward(pass.projection.data(), saved.attention.data(), layer[kO].data, N, shape.q_dim(),
                 H);
  models::reduce_partial_sums(pass.tp, pass.projection.data(), N * H);
  residual_forward(saved.h.data(), x, pass.projection.data(), N * H);

  rmsnorm_out_of_line(saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm],
                      pass);
  linear_forward(saved.gate_up.data(), saved.norm2.data(), layer[kGate].data, N, H, 2 * I);
  swiglu_out_of_line(saved.mlp.data(), saved.gate_up.data(), pass);
  linear_forward(pass.projection.data(), saved.mlp.data(), layer[kDown].data, N, I, H);
  models::reduce_partial_sums(pass.tp, pass.projection.data(), N * H);
  residual_forward(out, saved.h.data(), pass.projection.data(), N * H);
}

// Each residual add passes its gradient through, so the norms' backward
// accumulates into d_residual. Every linear's input gradient comes first and
// its weight gradient goes to `gradients` right after, while dy is at hand.
void Llama::layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                           LayerActivations& saved, WeightGradients& gradients) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate, Q = shape.q_dim();
  float* d_residual = pass.d_residual.data();

  linear_backward_input(pass.d_mlp.data(), d_residual, layer[kDown].data, N, I, H);
  gradients.linear({&layer[kDown], &layer[kDown], kOutIn, N, I, H}, d_residual, saved.mlp);
  swiglu_backward(pass.d_gate_up.data(), pass.d_mlp.data(), saved.gate_up.data(), N, I);
  linear_backward_input(pass.d_norm.data(), pass.d_gate_up.data(), layer[kGate].data, N, H, 2 * I);
  models::reduce_partial_sums(pass.tp, pass.d_norm.data(), N * H);
  gradients.linear({&layer[kGate], &layer[kUp], kOutIn, N, H, 2 * I}, pass.d_gate_up.data(),
                   saved.norm2);
  rmsnorm_backward(d_residual, layer[kPostNorm].grad, pass.d_norm.data(), saved.h.data(),
                   layer[kPostNorm].data, saved.rstd2.data(), N, H);
  gradients.vector_ready(layer[kPostNorm]);

  linear_backward_input(pass.d_attention.data(), d_residual, layer[kO].data, N, Q, H);
  gradients.linear({&layer[kO], &layer[kO], kOutIn, N, Q, H}, d_residual, saved.attention);
  attention_backward(pass.d_qkv.data(), pass.d_scores.data(), pass.d_attention.data(),
                     saved.qkv.data(), saved.probs.data(), shape);
  rotary_backward(pass.d_qkv.data(), pass.rotary, shape.batch, shape.seq_len,
                  shape.heads + shape.kv_heads, shape.qkv_dim());
  linear_backward_input(pass.d_norm.data(), pass.d_qkv.data(), layer[kQ].data, N, H,
                        shape.qkv_dim());
  models::reduce_partial_sums(pass.tp, pass.d_norm.data(), N * H);
  gradients.linear({&layer[kQ], &layer[kV], kOutIn, N, H, shape.qkv_dim()}, pass.d_qkv.data(),
                   saved.norm1);
  rmsnorm_backward(d_residual, layer[kInputNorm].grad, pass.d_norm.data(), x,
                   layer[kInputNorm].data, saved.rstd1.data(), N, H);
  gradients.vector_ready(layer[kInputNorm]);
}

// As layer_forward computes them.
void Llama::recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                  LayerActivations& saved) {
  rmsnorm_out_of_line(saved.norm1.data(), saved.rstd1.data(), x, layer[kInputNorm], pass);
  rmsnorm_out_of_line(saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm],
                      pass);
  swiglu_out_of_line(saved.mlp.data(), saved.gate_up.data(), pass);
}

double Llama::head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                           const float* x, const int32_t* targets, HeadActivations& saved) {
  const int64_t N = pass.rows(), H = pass.hidden;
  rmsnorm_forward(saved.final_norm.data(), saved.final_rstd.data(), x, head->data, N, H, pass.eps);
  return models::lm_head_loss_forward(saved.logits.data(), saved.final_norm.data(), lm_head,
                                      targets, N, H, pass.vocab, pass.tp);
}

void Llama::head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                          const float* x, const int32_t* targets, float loss_scale,
                          HeadActivations& saved, WeightGradients& gradients) {
  const int64_t N = pass.rows(), H = pass.hidden;
  models::lm_head_loss_backward(pass.d_norm.data(), saved.logits.data(), lm_head, saved.final_norm,
                                targets, loss_scale, N, H, pass.vocab, pass.tp, gradients);
  std::fill(pass.d_residual.begin(), pass.d_residual.end(), 0.0f);
  rmsnorm_backward(pass.d_residual.data(), head->grad, pass.d_norm.data(), x, head->data,
                   saved.final_rstd.data(), N, H);
  gradients.vector_ready(*head);
}

}  // namespace meshrun::llama
