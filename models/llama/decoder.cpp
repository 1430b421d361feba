#include "llama/decoder.hpp"

#include <algorithm>
#include <stdexcept>

#include "common/support.hpp"

namespace meshrun::llama {

using namespace kernels;
using models::Block;
using models::bytes_of;
using models::weight_of;
using models::WeightLayout;

constexpr WeightLayout kOutIn = WeightLayout::out_in;

namespace {

// The element-wise steps of a layer's forward, out of line: selective
// checkpointing computes them again in the backward, and one copy of the
// code gives the same bits where inlined copies may vectorize differently.
[[gnu::noinline]] void rmsnorm_out_of_line(float* y, float* rstd, const float* x,
                                           const ParameterView& norm, const DecoderPass& pass) {
  rmsnorm_forward(y, rstd, x, norm.data, pass.stream_rows(), pass.hidden, pass.eps);
}
[[gnu::noinline]] void swiglu_out_of_line(float* y, const float* gate_up, const DecoderPass& pass) {
  swiglu_forward(y, gate_up, pass.rows(), pass.intermediate);
}

// The norm before a column-parallel block: on the rank's stream rows, into
// `out` [N, H], gathered from the ranks' rows with sequence parallelism.
void block_input_norm(DecoderPass& pass, float* out, float* rstd, const float* x,
                      const ParameterView& norm) {
  float* rows = pass.sequence_parallel ? pass.stream.data() : out;
  rmsnorm_out_of_line(rows, rstd, x, norm, pass);
  if (pass.sequence_parallel)
    models::gather_rows(pass.tp, rows, out, pass.stream_rows(), pass.hidden);
}

// pass.projection, a row-parallel block's partial output [N, H], summed over
// the block's group: all of it in place, or the rank's rows into
// pass.stream (sequence parallel). Returns where the sum is.
const float* finish_row_parallel(DecoderPass& pass, TensorParallelGroup& group) {
  if (!pass.sequence_parallel) {
    models::reduce_partial_sums(group, pass.projection.data(), pass.rows() * pass.hidden);
    return pass.projection.data();
  }
  models::reduce_scatter_rows(group, pass.projection.data(), pass.stream.data(), pass.stream_rows(),
                              pass.hidden);
  return pass.stream.data();
}

// The gradient of a block's output [N, H]: the residual stream's, gathered
// from the ranks' rows with sequence parallelism.
float* block_output_gradient(DecoderPass& pass) {
  if (!pass.sequence_parallel) return pass.d_residual.data();
  models::gather_rows(pass.tp, pass.d_residual.data(), pass.d_gathered.data(), pass.stream_rows(),
                      pass.hidden);
  return pass.d_gathered.data();
}

// Starts the sum over the block's group of pass.d_norm, the block's partial
// input gradient [N, H]: all of it in place, or the rank's rows into
// pass.stream (sequence parallel). With asynchronous tensor parallelism it
// runs while the caller computes the block's weight gradients.
void start_input_gradient_sum(DecoderPass& pass, TensorParallelGroup& group) {
  if (!pass.sequence_parallel) {
    if (group.size() > 1) group.start_all_reduce_sum(pass.d_norm.data(), pass.rows() * pass.hidden);
    return;
  }
  group.start_reduce_scatter_sum(pass.d_norm.data(), pass.stream.data(),
                                 pass.stream_rows() * pass.hidden);
}

// block_input_norm's backward, once the sum start_input_gradient_sum began
// is complete: through the norm into the residual stream's gradient. With
// sequence parallelism each rank has the norm weight's gradient of its rows
// only, so that is summed over tp too.
void block_input_norm_backward(DecoderPass& pass, TensorParallelGroup& group,
                               const ParameterView& norm, const float* x, const float* rstd) {
  group.wait_started();
  const int64_t n = pass.stream_rows(), H = pass.hidden;
  if (!pass.sequence_parallel) {
    rmsnorm_backward(pass.d_residual.data(), norm.grad, pass.d_norm.data(), x, norm.data, rstd, n,
                     H);
    return;
  }
  std::fill_n(pass.d_norm_weight.data(), pass.d_norm_weight.size(), 0.0f);
  rmsnorm_backward(pass.d_residual.data(), pass.d_norm_weight.data(), pass.stream.data(), x,
                   norm.data, rstd, n, H);
  pass.tp.all_reduce_sum(pass.d_norm_weight.data(), H);
  for (int64_t i = 0; i < H; ++i) norm.grad[i] += pass.d_norm_weight.data()[i];
}

}  // namespace

DecoderPass::DecoderPass(const LlamaConfig& c, int64_t batch, int64_t seq_len,
                         TensorParallelGroup& tp, bool sequence_parallel,
                         const models::ParallelBlocks& blocks, const models::ContextParallel& cp)
    : tp(tp),
      replicated(tp),
      blocks(blocks),
      sequence_parallel(sequence_parallel),
      attention{batch, seq_len, blocks.local(Block::attention, c.num_attention_heads, tp),
                blocks.local(Block::attention, c.num_key_value_heads, tp),
                c.hidden_size / c.num_attention_heads},
      hidden(c.hidden_size),
      intermediate(blocks.local(Block::mlp, c.intermediate_size, tp)),
      embedding_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::embedding)),
      head_vocab(models::vocab_shard(c.vocab_size, tp, blocks, Block::head)),
      eps(c.rms_norm_eps),
      attend(attention, cp, Llama::kName),
      rotary(attention.head_dim, attend.positions(), c.rope_theta),
      projection(rows() * hidden),
      d_residual(rows() * hidden),
      d_norm(rows() * hidden),
      d_qkv(rows() * attention.qkv_dim()),
      d_attention(rows() * attention.q_dim()),
      d_gate_up(rows() * 2 * intermediate),
      d_mlp(rows() * intermediate),
      stream(sequence_parallel ? stream_numel() : 0),
      d_gathered(sequence_parallel ? rows() * hidden : 0),
      d_norm_weight(sequence_parallel ? hidden : 0) {
  models::require(!sequence_parallel || rows() % tp.size() == 0, Llama::kName,
                  "sequence parallelism shards the " + std::to_string(rows()) +
                      " rows of a micro-batch over " + std::to_string(tp.size()) +
                      " tp ranks, which do not divide them");
}

AttentionActivations::AttentionActivations(const DecoderPass& pass)
    : norm1(pass.rows() * pass.hidden),
      rstd1(pass.stream_rows()),
      qkv(pass.rows() * pass.attention.qkv_dim()),
      lse(pass.attention.lse_size()),
      attention(pass.rows() * pass.attention.q_dim()),
      h(pass.stream_numel()) {}

int64_t AttentionActivations::bytes() const {
  return bytes_of(norm1, rstd1, qkv, lse, attention, h);
}

LayerActivations::LayerActivations(const DecoderPass& pass)
    : AttentionActivations(pass),
      norm2(pass.rows() * pass.hidden),
      rstd2(pass.stream_rows()),
      gate_up(pass.rows() * 2 * pass.intermediate),
      mlp(pass.rows() * pass.intermediate) {}

int64_t LayerActivations::bytes() const {
  return AttentionActivations::bytes() + bytes_of(norm2, rstd2, gate_up, mlp);
}

HeadActivations::HeadActivations(const DecoderPass& pass)
    : final_norm(pass.rows() * pass.hidden),
      final_rstd(pass.stream_rows()),
      logits(pass.rows() * pass.head_vocab.size) {}

int64_t HeadActivations::bytes() const { return bytes_of(final_norm, final_rstd, logits); }

void check_attention_storage(const ParameterView* layer, bool backward) {
  if (!models::adjacent_views(&layer[kQ], &layer[kV], backward)) {
    throw std::invalid_argument("the host gave " +
                                layer[kQ].name.substr(0, layer[kQ].name.rfind(".self_attn")) +
                                " storage that is not one block in parameter order");
  }
}

// q, k, v and gate, up act as one fused projection each: the host lays a
// unit's parameters out one after another (meshrun/model.h).
void Llama::check_layer_storage(std::span<const ParameterView> views, bool backward) {
  const ParameterView* layer = views.data();
  check_attention_storage(layer, backward);
  if (!models::adjacent_views(&layer[kGate], &layer[kUp], backward)) {
    throw std::invalid_argument("llama: the host gave " +
                                layer[kGate].name.substr(0, layer[kGate].name.rfind(".mlp")) +
                                " storage that is not one block in parameter order");
  }
}

void Llama::embedding_forward(Pass& pass, const ParameterView* embedding, const int32_t* tokens,
                              float* out) {
  models::embedding_into_stream(out, pass.projection.data(), tokens, embedding->data, pass.rows(),
                                pass.hidden, pass.embedding_vocab, pass.group(Block::embedding),
                                pass.sequence_parallel);
}

void Llama::embedding_backward(Pass& pass, const ParameterView* embedding, const int32_t* tokens) {
  models::vocab_parallel_embedding_backward(embedding->grad, tokens, block_output_gradient(pass),
                                            pass.rows(), pass.hidden, pass.embedding_vocab);
}

void attention_norm(DecoderPass& pass, const ParameterView* layer, const float* x,
                    AttentionActivations& saved) {
  block_input_norm(pass, saved.norm1.data(), saved.rstd1.data(), x, layer[kInputNorm]);
}

void attention_forward(DecoderPass& pass, const ParameterView* layer, const float* x,
                       AttentionActivations& saved) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden, n = pass.stream_rows();
  block_input_norm(pass, saved.norm1.data(), saved.rstd1.data(), x, layer[kInputNorm]);
  linear_forward(saved.qkv.data(), saved.norm1.data(), weight_of(layer[kQ]), N, H, shape.qkv_dim());
  rotary_forward(saved.qkv.data(), pass.rotary, shape.batch, shape.seq_len,
                 shape.heads + shape.kv_heads, shape.qkv_dim());
  pass.attend.forward(saved.attention.data(), saved.lse.data(), saved.qkv.data());
  linear_forward(pass.projection.data(), saved.attention.data(), weight_of(layer[kO]), N,
                 shape.q_dim(), H);
  residual_forward(saved.h.data(), x, finish_row_parallel(pass, pass.group(Block::attention)),
                   n * H);
  models::round_kept(pass.bfloat16_activations, saved.h);
}

void Llama::layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                          LayerActivations& saved, float* out) {
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate, n = pass.stream_rows();
  attention_forward(pass, layer, x, saved);
  block_input_norm(pass, saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm]);
  linear_forward(saved.gate_up.data(), saved.norm2.data(), weight_of(layer[kGate]), N, H, 2 * I);
  models::round_kept(pass.bfloat16_activations, saved.gate_up);
  swiglu_out_of_line(saved.mlp.data(), saved.gate_up.data(), pass);
  linear_forward(pass.projection.data(), saved.mlp.data(), weight_of(layer[kDown]), N, I, H);
  residual_forward(out, saved.h.data(), finish_row_parallel(pass, pass.group(Block::mlp)), n * H);
}

// Each residual add passes its gradient through, so the norms' backward
// accumulates into d_residual. Every linear's input gradient comes first and
// its weight gradient goes to `gradients` right after, while dy is at hand;
// a block's input gradient is summed over tp meanwhile.
void Llama::layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                           LayerActivations& saved, WeightGradients& gradients) {
  const int64_t N = pass.rows(), H = pass.hidden, I = pass.intermediate;
  float* d_out = block_output_gradient(pass);
  linear_backward_input(pass.d_mlp.data(), d_out, weight_of(layer[kDown]), N, I, H);
  gradients.linear({&layer[kDown], &layer[kDown], kOutIn, N, I, H}, d_out, saved.mlp);
  swiglu_backward(pass.d_gate_up.data(), pass.d_mlp.data(), saved.gate_up.data(), N, I);
  linear_backward_input(pass.d_norm.data(), pass.d_gate_up.data(), weight_of(layer[kGate]), N, H,
                        2 * I);
  start_input_gradient_sum(pass, pass.group(Block::mlp));
  gradients.linear({&layer[kGate], &layer[kUp], kOutIn, N, H, 2 * I}, pass.d_gate_up.data(),
                   saved.norm2);
  block_input_norm_backward(pass, pass.group(Block::mlp), layer[kPostNorm], saved.h.data(),
                            saved.rstd2.data());
  gradients.vector_ready(layer[kPostNorm]);
  attention_backward(pass, layer, x, saved, gradients);
}

void attention_backward(DecoderPass& pass, const ParameterView* layer, const float* x,
                        AttentionActivations& saved, WeightGradients& gradients) {
  const AttentionShape& shape = pass.attention;
  const int64_t N = pass.rows(), H = pass.hidden, Q = shape.q_dim();
  float* d_h = block_output_gradient(pass);
  linear_backward_input(pass.d_attention.data(), d_h, weight_of(layer[kO]), N, Q, H);
  // Attention's backward reads its output, which o_proj's gradient may take.
  pass.attend.backward(pass.d_qkv.data(), pass.d_attention.data(), saved.qkv.data(),
                       saved.attention.data(), saved.lse.data());
  gradients.linear({&layer[kO], &layer[kO], kOutIn, N, Q, H}, d_h, saved.attention);
  rotary_backward(pass.d_qkv.data(), pass.rotary, shape.batch, shape.seq_len,
                  shape.heads + shape.kv_heads, shape.qkv_dim());
  linear_backward_input(pass.d_norm.data(), pass.d_qkv.data(), weight_of(layer[kQ]), N, H,
                        shape.qkv_dim());
  start_input_gradient_sum(pass, pass.group(Block::attention));
  gradients.linear({&layer[kQ], &layer[kV], kOutIn, N, H, shape.qkv_dim()}, pass.d_qkv.data(),
                   saved.norm1);
  block_input_norm_backward(pass, pass.group(Block::attention), layer[kInputNorm], x,
                            saved.rstd1.data());
  gradients.vector_ready(layer[kInputNorm]);
}

// As layer_forward computes them.
void Llama::recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                  LayerActivations& saved) {
  block_input_norm(pass, saved.norm1.data(), saved.rstd1.data(), x, layer[kInputNorm]);
  block_input_norm(pass, saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm]);
  swiglu_out_of_line(saved.mlp.data(), saved.gate_up.data(), pass);
}

double Llama::head_forward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                           const float* x, const int32_t* targets, HeadActivations& saved) {
  block_input_norm(pass, saved.final_norm.data(), saved.final_rstd.data(), x, *head);
  return models::lm_head_loss_forward(saved.logits.data(), saved.final_norm.data(), lm_head,
                                      targets, pass.rows(), pass.hidden, pass.head_vocab,
                                      pass.group(Block::head));
}

void Llama::head_backward(Pass& pass, const ParameterView* head, const ParameterView& lm_head,
                          const float* x, const int32_t* targets, float loss_scale,
                          HeadActivations& saved, WeightGradients& gradients) {
  models::lm_head_loss_backward(pass.d_norm.data(), saved.logits.data(), lm_head, saved.final_norm,
                                targets, loss_scale, pass.rows(), pass.hidden, pass.head_vocab,
                                gradients);
  std::fill_n(pass.d_residual.data(), pass.d_residual.size(), 0.0f);
  start_input_gradient_sum(pass, pass.group(Block::head));
  block_input_norm_backward(pass, pass.group(Block::head), *head, x, saved.final_rstd.data());
  gradients.vector_ready(*head);
}

}  // namespace meshrun::llama
