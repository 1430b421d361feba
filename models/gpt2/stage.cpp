#include "gpt2/stage.hpp"

#include <algorithm>
#include <string>

#include "common/stage_impl.hpp"
#include "common/support.hpp"

template class meshrun::models::TransformerStage<meshrun::gpt2::Gpt2>;

namespace meshrun::gpt2 {

using namespace kernels;
using models::Block;
using models::bytes_of;
using models::weight_of;
using models::WeightLayout;

namespace {

// y = x W + b of the Conv1D whose weight is conv[0] and bias conv[1].
void conv1d_bias_forward(float* y, const float* x, const ParameterView* conv, int64_t rows,
                         int64_t in, int64_t out) {
  conv1d_forward(y, x, weight_of(conv[0]), rows, in, out);
  bias_forward(y, conv[1].data, rows, out);
}

// The row-parallel c_proj: y = sum over tp of x_r W_r, then + b once.
void row_parallel_forward(float* y, const float* x, const ParameterView* conv, int64_t rows,
                          int64_t in, int64_t out, models::TensorParallelGroup& tp) {
  conv1d_forward(y, x, weight_of(conv[0]), rows, in, out);
  models::reduce_partial_sums(tp, y, rows * out);
  bias_forward(y, conv[1].data, rows, out);
}

// The bias's gradient at once, the weight's (x^T dy) to `gradients`, which
// may take x.
void conv1d_parameter_gradients(const float* dy, const ParameterView* conv,
                                models::Buffer<float>& x, int64_t rows, int64_t in, int64_t out,
                                WeightGradients& gradients) {
  bias_backward(conv[1].grad, dy, rows, out);
  gradients.vector_ready(conv[1]);
  gradients.linear({&conv[0], &conv[0], WeightLayout::in_out, rows, in, out}, dy, x);
}

// The row-parallel c_proj: dx = dy W^T, complete on each rank; then the
// parameters' gradients.
void conv1d_bias_backward(float* dx, const float* dy, const ParameterView* conv,
                          models::Buffer<float>& x, int64_t rows, int64_t in, int64_t out,
                          WeightGradients& gradients) {
  conv1d_backward_input(dx, dy, weight_of(conv[0]), rows, in, out);
  conv1d_parameter_gradients(dy, conv, x, rows, in, out, gradients);
}

// The column-parallel c_attn or c_fc: dx = dy W^T is a partial sum, whose
// sum over `group` starts at once and runs while the parameters' gradients
// are computed (asynchronous tensor parallelism); the caller waits for it.
void column_parallel_backward(float* dx, const float* dy, const ParameterView* conv,
                              models::Buffer<float>& x, int64_t rows, int64_t in, int64_t out,
                              models::TensorParallelGroup& group, WeightGradients& gradients) {
  conv1d_backward_input(dx, dy, weight_of(conv[0]), rows, in, out);
  if (group.size() > 1) group.start_all_reduce_sum(dx, rows * in);
  conv1d_parameter_gradients(dy, conv, x, rows, in, out, gradients);
}

// dx += the LayerNorm's input gradient; its weight's (norm[0]) and bias's
// (norm[1]) gradients are final.
void layernorm_backward_ready(float* dx, const float* dy, const float* x, const ParameterView* norm,
                              const float* mean, const float* rstd, int64_t rows, int64_t dim,
                              WeightGradients& gradients) {
  layernorm_backward(dx, norm[0].grad, norm[1].grad, dy, x, norm[0].data, mean, rstd, rows, dim);
  gradients.vector_ready(norm[1]);
  gradients.vector_ready(norm[0]);
}

// The element-wise steps of a block's forward, out of line: selective
// checkpointing computes them again in the backward, and one copy of the
// code gives the same bits where inlined copies may vectorize differently.
[[gnu::noinline]] void layernorm_out_of_line(float* y, float* mean, float* rstd, const float* x,
                                             const ParameterView* norm, const BlockPass& pass) {
  layernorm_forward(y, mean, rstd, x, norm[0].data, norm[1].data, pass.rows(), pass.hidden,
                    pass.eps);
}
[[gnu::noinline]] void gelu_out_of_line(float* y, const float* x, int64_t count) {
  gelu_forward(y, x, count);
}

}  // namespace

BlockPass::BlockPass(const Gpt2Config& c, int64_t batch, int64_t seq_len,
                     models::TensorParallelGroup& tp, bool /*sequence_parallel*/,
                     const models::ParallelBlocks& blocks, const models::ContextParallel& cp)
    : tp(tp),
      replicated(tp),
      blocks(blocks),
      attention{batch, seq_len, blocks.local(Block::attention, c.n_head, tp),
                blocks.local(Block::attention, c.n_head, tp), c.n_embd / c.n_head},
      hidden(c.n_embd),
      inner(blocks.local(Block::mlp, c.n_inner, tp)),
      embedding_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::embedding)),
      head_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::head)),
      eps(c.layer_norm_epsilon),
      positions(rows()),
      projection(rows() * hidden),
      d_residual(rows() * hidden),
      attend(attention, cp, Gpt2::kName),
      d_norm(rows() * hidden),
      d_qkv(rows() * attention.qkv_dim()),
      d_attention(rows() * attention.q_dim()),
      d_mlp(rows() * inner) {
  const int64_t sequence = seq_len * cp.size();
  models::require(sequence <= c.n_positions, Gpt2::kName,
                  "seq_len " + std::to_string(sequence) + " is beyond n_positions " +
                      std::to_string(c.n_positions) + " (transformer.wpe has a row per position)");
  const std::vector<int64_t>& in_sequence = attend.positions();
  for (int64_t r = 0; r < rows(); ++r)
    positions[size_t(r)] = int32_t(in_sequence[size_t(r % seq_len)]);
}

BlockActivations::BlockActivations(const BlockPass& pass)
    : ln1(pass.rows() * pass.hidden),
      mean1(pass.rows()),
      rstd1(pass.rows()),
      qkv(pass.rows() * pass.attention.qkv_dim()),
      lse(pass.attention.lse_size()),
      attention(pass.rows() * pass.attention.q_dim()),
      h(pass.rows() * pass.hidden),
      ln2(pass.rows() * pass.hidden),
      mean2(pass.rows()),
      rstd2(pass.rows()),
      fc(pass.rows() * pass.inner),
      act(pass.rows() * pass.inner) {}

int64_t BlockActivations::bytes() const {
  return bytes_of(ln1, mean1, rstd1, qkv, lse, attention, h, ln2, mean2, rstd2, fc, act);
}

HeadActivations::HeadActivations(const BlockPass& pass)
    : final_norm(pass.rows() * pass.hidden),
      final_mean(pass.rows()),
      final_rstd(pass.rows()),
      logits(pass.rows() * pass.head_vocab.size) {}

int64_t HeadActivations::bytes() const {
  return bytes_of(final_norm, final_mean, final_rstd, logits);
}

void Gpt2::embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                             float* out) {
  const int64_t N = pass.rows(), E = pass.hidden;
  models::vocab_parallel_embedding_forward(out, tokens, embedding[0].data, N, E,
                                           pass.embedding_vocab, pass.group(Block::embedding));
  kernels::embedding_forward(pass.projection.data(), pass.positions.data(), embedding[1].data, N,
                             E);
  residual_forward(out, out, pass.projection.data(), N * E);
}

void Gpt2::embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens) {
  const int64_t N = pass.rows(), E = pass.hidden;
  models::vocab_parallel_embedding_backward(embedding[0].grad, tokens, pass.d_residual.data(), N, E,
                                            pass.embedding_vocab);
  kernels::embedding_backward(embedding[1].grad, pass.positions.data(), pass.d_residual.data(), N,
                              E);
}

void Gpt2::layer_forward(Pass& pass, const ParameterView* block, const float* x,
                         LayerActivations& saved, float* out) {
  const int64_t N = pass.rows(), E = pass.hidden, I = pass.inner, Q = pass.attention.q_dim();
  float* projection = pass.projection.data();

  layernorm_out_of_line(saved.ln1.data(), saved.mean1.data(), saved.rstd1.data(), x,
                        &block[kLn1Weight], pass);
  conv1d_bias_forward(saved.qkv.data(), saved.ln1.data(), &block[kAttnWeight], N, E, 3 * Q);
  pass.attend.forward(saved.attention.data(), saved.lse.data(), saved.qkv.data());
  row_parallel_forward(projection, saved.attention.data(), &block[kAttnProjWeight], N, Q, E,
                       pass.group(Block::attention));
  residual_forward(saved.h.data(), x, projection, N * E);
  models::round_kept(pass.bfloat16_activations, saved.h);

  layernorm_out_of_line(saved.ln2.data(), saved.mean2.data(), saved.rstd2.data(), saved.h.data(),
                        &block[kLn2Weight], pass);
  conv1d_bias_forward(saved.fc.data(), saved.ln2.data(), &block[kFcWeight], N, E, I);
  models::round_kept(pass.bfloat16_activations, saved.fc);
  gelu_out_of_line(saved.act.data(), saved.fc.data(), N * I);
  row_parallel_forward(projection, saved.act.data(), &block[kMlpProjWeight], N, I, E,
                       pass.group(Block::mlp));
  residual_forward(out, saved.h.data(), projection, N * E);
}

// Each residual add passes its gradient through, so the norms' backward
// accumulates into d_residual. Every Conv1D's input gradient comes first and
// its parameters' gradients right after, while dy is at hand.
void Gpt2::layer_backward(Pass& pass, const ParameterView* block, const float* x,
                          LayerActivations& saved, WeightGradients& gradients) {
  const int64_t N = pass.rows(), E = pass.hidden, I = pass.inner, Q = pass.attention.q_dim();
  float* d_residual = pass.d_residual.data();
  float* d_norm = pass.d_norm.data();

  conv1d_bias_backward(pass.d_mlp.data(), d_residual, &block[kMlpProjWeight], saved.act, N, I, E,
                       gradients);
  gelu_backward(pass.d_mlp.data(), pass.d_mlp.data(), saved.fc.data(), N * I);
  column_parallel_backward(d_norm, pass.d_mlp.data(), &block[kFcWeight], saved.ln2, N, E, I,
                           pass.group(Block::mlp), gradients);
  pass.group(Block::mlp).wait_started();
  layernorm_backward_ready(d_residual, d_norm, saved.h.data(), &block[kLn2Weight],
                           saved.mean2.data(), saved.rstd2.data(), N, E, gradients);

  // Attention's backward reads its output, which the parameters' gradients
  // may then take.
  conv1d_backward_input(pass.d_attention.data(), d_residual, weight_of(block[kAttnProjWeight]), N,
                        Q, E);
  pass.attend.backward(pass.d_qkv.data(), pass.d_attention.data(), saved.qkv.data(),
                       saved.attention.data(), saved.lse.data());
  conv1d_parameter_gradients(d_residual, &block[kAttnProjWeight], saved.attention, N, Q, E,
                             gradients);
  column_parallel_backward(d_norm, pass.d_qkv.data(), &block[kAttnWeight], saved.ln1, N, E, 3 * Q,
                           pass.group(Block::attention), gradients);
  pass.group(Block::attention).wait_started();
  layernorm_backward_ready(d_residual, d_norm, x, &block[kLn1Weight], saved.mean1.data(),
                           saved.rstd1.data(), N, E, gradients);
}

// As layer_forward computes them.
void Gpt2::recompute_elementwise(Pass& pass, const ParameterView* block, const float* x,
                                 LayerActivations& saved) {
  layernorm_out_of_line(saved.ln1.data(), saved.mean1.data(), saved.rstd1.data(), x,
                        &block[kLn1Weight], pass);
  layernorm_out_of_line(saved.ln2.data(), saved.mean2.data(), saved.rstd2.data(), saved.h.data(),
                        &block[kLn2Weight], pass);
  gelu_out_of_line(saved.act.data(), saved.fc.data(), pass.rows() * pass.inner);
}

double Gpt2::head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                          const float* x, const int32_t* targets, HeadActivations& saved) {
  const int64_t N = pass.rows(), E = pass.hidden;
  layernorm_forward(saved.final_norm.data(), saved.final_mean.data(), saved.final_rstd.data(), x,
                    head[0].data, head[1].data, N, E, pass.eps);
  return models::lm_head_loss_forward(saved.logits.data(), saved.final_norm.data(), lm_head,
                                      targets, N, E, pass.head_vocab, pass.group(Block::head));
}

void Gpt2::head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                         const float* x, const int32_t* targets, float loss_scale,
                         HeadActivations& saved, WeightGradients& gradients) {
  const int64_t N = pass.rows(), E = pass.hidden;
  models::lm_head_loss_backward(pass.d_norm.data(), saved.logits.data(), lm_head, saved.final_norm,
                                targets, loss_scale, N, E, pass.head_vocab, gradients);
  models::reduce_partial_sums(pass.group(Block::head), pass.d_norm.data(), N * E);
  std::fill_n(pass.d_residual.data(), pass.d_residual.size(), 0.0f);
  layernorm_backward_ready(pass.d_residual.data(), pass.d_norm.data(), x, head,
                           saved.final_mean.data(), saved.final_rstd.data(), N, E, gradients);
}

}  // namespace meshrun::gpt2
