#include "mixtral/moe.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "common/layers.hpp"
#include "common/support.hpp"

namespace meshrun::mixtral {

using namespace kernels;
using models::bytes_of;
using models::WeightLayout;

namespace {

const ParameterView& expert_view(const ParameterView* layer, int64_t local, int64_t tensor) {
  return layer[kFirstExpert + local * kTensorsPerExpert + tensor];
}
enum ExpertTensor { kW1, kW3, kW2 };

// norm2 = rmsnorm(h), out of line: selective checkpointing computes it
// again in the backward, and one copy of the code gives the same bits.
[[gnu::noinline]] void moe_input_norm(MoeActivations& saved, const ParameterView* layer,
                                      const MoePass& pass) {
  rmsnorm_forward(saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm].data,
                  pass.rows(), pass.hidden, pass.eps);
}

// probs [N, E] = softmax of each row, in place.
void softmax_rows(float* probs, int64_t rows, int64_t experts) {
  for (int64_t n = 0; n < rows; ++n) {
    float* row = probs + n * experts;
    const float top = *std::max_element(row, row + experts);
    float sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += row[e] = std::exp(row[e] - top);
    for (int64_t e = 0; e < experts; ++e) row[e] /= sum;
  }
}

// The top_k experts of each row by probability (strictly greater wins, so
// ties go to the lower expert on every rank alike), and their
// probabilities renormalized to sum to 1.
void route(MoeActivations& saved, const MoePass& pass) {
  const int64_t N = pass.rows(), E = pass.experts, K = pass.top_k;
  for (int64_t n = 0; n < N; ++n) {
    const float* p = saved.probs.data() + n * E;
    int32_t* picked = saved.selected.data() + n * K;
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int32_t best = -1;
      for (int32_t e = 0; e < E; ++e) {
        if (std::find(picked, picked + k, e) != picked + k) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      picked[k] = best;
      sum += p[best];
    }
    for (int64_t k = 0; k < K; ++k) saved.weights[size_t(n * K + k)] = p[picked[k]] / sum;
  }
}

// Dispatch order: the slots grouped by expert (so by the experts' ranks),
// tokens in order within an expert; the counts each rank sends.
void order_slots(MoeActivations& saved, const MoePass& pass) {
  const int64_t N = pass.rows(), E = pass.experts, K = pass.top_k, H = pass.hidden;
  std::fill(saved.tokens_per_expert.begin(), saved.tokens_per_expert.end(), 0);
  for (const int32_t e : saved.selected) ++saved.tokens_per_expert[size_t(e)];
  std::vector<int64_t> next(size_t(E), 0);
  for (int64_t e = 1; e < E; ++e) {
    next[size_t(e)] = next[size_t(e - 1)] + saved.tokens_per_expert[size_t(e - 1)];
  }
  for (int64_t slot = 0; slot < N * K; ++slot) {
    saved.slot_position[size_t(slot)] = next[size_t(saved.selected[size_t(slot)])]++;
  }
  std::fill(saved.send_counts.begin(), saved.send_counts.end(), 0);
  for (int64_t e = 0; e < E; ++e) {
    saved.send_counts[size_t(e / pass.local_experts)] += saved.tokens_per_expert[size_t(e)] * H;
  }
}

// Each rank tells each other how many rows it sends to each of their
// experts (the receivers' rows_from), then the rows go.
void exchange_counts(MoeActivations& saved, MoePass& pass) {
  const int64_t ranks = pass.ep.size(), El = pass.local_experts, H = pass.hidden;
  std::vector<float> mine(saved.tokens_per_expert.begin(), saved.tokens_per_expert.end());
  std::vector<float> theirs(size_t(ranks * El));
  const std::vector<int64_t> each(size_t(ranks), El);
  pass.ep.all_to_all(mine.data(), each, theirs.data(), each);
  std::fill(saved.recv_counts.begin(), saved.recv_counts.end(), 0);
  for (int64_t i = 0; i < ranks * El; ++i) {
    saved.rows_from[size_t(i)] = int64_t(theirs[size_t(i)]);
    saved.recv_counts[size_t(i / El)] += saved.rows_from[size_t(i)] * H;
  }
}

// The floats a dispatch brings this rank.
int64_t received_floats(const MoeActivations& saved) {
  int64_t received = 0;
  for (const int64_t count : saved.recv_counts) received += count;
  return received;
}

// Visits the received rows of local expert j: (offset in the received
// buffer, offset in the expert's rows, rows), source rank by source rank.
template <class Visit>
void for_expert_rows(const MoeActivations& saved, const MoePass& pass, int64_t j, Visit&& visit) {
  const int64_t El = pass.local_experts, H = pass.hidden;
  int64_t source_begin = 0, expert_row = 0;
  for (int64_t source = 0; source < pass.ep.size(); ++source) {
    int64_t row = source_begin / H;
    for (int64_t i = 0; i < j; ++i) row += saved.rows_from[size_t(source * El + i)];
    const int64_t rows = saved.rows_from[size_t(source * El + j)];
    visit(row * H, expert_row * H, rows * H);
    expert_row += rows;
    source_begin += saved.recv_counts[size_t(source)];
  }
}

int64_t rows_of_expert(const MoeActivations& saved, const MoePass& pass, int64_t j) {
  int64_t rows = 0;
  for (int64_t source = 0; source < pass.ep.size(); ++source) {
    rows += saved.rows_from[size_t(source * pass.local_experts + j)];
  }
  return rows;
}

// E / N sum_e tokens_e P_e, P_e the mean router probability of expert e
// (Hugging Face's load_balancing_loss_func on one layer).
double load_balancing_loss(const MoeActivations& saved, const MoePass& pass) {
  const int64_t N = pass.rows(), E = pass.experts;
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    double mean_prob = 0;
    for (int64_t n = 0; n < N; ++n) mean_prob += saved.probs[size_t(n * E + e)];
    loss += double(saved.tokens_per_expert[size_t(e)]) * mean_prob / double(N);
  }
  return loss * double(E) / double(N);
}

// The experts' forward on the rows they received: xin -> w2(silu(w1 x) * w3 x).
void experts_forward(const ParameterView* layer, MoeActivations& saved, MoePass& pass) {
  const int64_t H = pass.hidden, I = pass.intermediate;
  pass.returned.resize(pass.received.size());
  for (int64_t j = 0; j < pass.local_experts; ++j) {
    const int64_t rows = rows_of_expert(saved, pass, j);
    auto& in = saved.expert_in[size_t(j)];
    in.resize(size_t(rows * H));
    saved.gate_up[size_t(j)].resize(size_t(rows * 2 * I));
    saved.act[size_t(j)].resize(size_t(rows * I));
    if (rows == 0) continue;
    for_expert_rows(saved, pass, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(pass.received.begin() + at, count, in.begin() + own);
    });
    linear_forward(saved.gate_up[size_t(j)].data(), in.data(), expert_view(layer, j, kW1).data,
                   rows, H, 2 * I);
    swiglu_forward(saved.act[size_t(j)].data(), saved.gate_up[size_t(j)].data(), rows, I);
    pass.expert_out.resize(size_t(rows * H));
    linear_forward(pass.expert_out.data(), saved.act[size_t(j)].data(),
                   expert_view(layer, j, kW2).data, rows, I, H);
    for_expert_rows(saved, pass, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(pass.expert_out.begin() + own, count, pass.returned.begin() + at);
    });
  }
}

// The experts' backward from the gradients of their outputs (pass.received,
// in received order) to those of their inputs (pass.returned).
void experts_backward(const ParameterView* layer, MoeActivations& saved, MoePass& pass,
                      WeightGradients& gradients) {
  const int64_t H = pass.hidden, I = pass.intermediate;
  pass.returned.resize(pass.received.size());
  for (int64_t j = 0; j < pass.local_experts; ++j) {
    const ParameterView& w1 = expert_view(layer, j, kW1);
    const ParameterView& w3 = expert_view(layer, j, kW3);
    const ParameterView& w2 = expert_view(layer, j, kW2);
    const int64_t rows = rows_of_expert(saved, pass, j);
    if (rows == 0) {
      for (const ParameterView* view : {&w2, &w3, &w1}) gradients.vector_ready(*view);
      continue;
    }
    pass.expert_out.resize(size_t(rows * H));
    for_expert_rows(saved, pass, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(pass.received.begin() + at, count, pass.expert_out.begin() + own);
    });
    pass.d_act.resize(size_t(rows * I));
    pass.d_gate_up_expert.resize(size_t(rows * 2 * I));
    pass.d_expert_in.resize(size_t(rows * H));
    linear_backward_input(pass.d_act.data(), pass.expert_out.data(), w2.data, rows, I, H);
    gradients.linear({&w2, &w2, WeightLayout::out_in, rows, I, H}, pass.expert_out.data(),
                     saved.act[size_t(j)]);
    swiglu_backward(pass.d_gate_up_expert.data(), pass.d_act.data(),
                    saved.gate_up[size_t(j)].data(), rows, I);
    linear_backward_input(pass.d_expert_in.data(), pass.d_gate_up_expert.data(), w1.data, rows, H,
                          2 * I);
    gradients.linear({&w1, &w3, WeightLayout::out_in, rows, H, 2 * I}, pass.d_gate_up_expert.data(),
                     saved.expert_in[size_t(j)]);
    for_expert_rows(saved, pass, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(pass.d_expert_in.begin() + own, count, pass.returned.begin() + at);
    });
  }
}

// d_probs from the routing weights' gradients d_w (w_k = p_k / sum_S p):
// dp_m = (dw_m - sum_k dw_k w_k) / sum_S p for the selected m; and from the
// load-balancing loss, c d/dp of E / N sum_e tokens_e mean_n p_ne, the
// token counts taken as constants (as Hugging Face's loss does).
void router_probability_gradient(const MoeActivations& saved, MoePass& pass,
                                 const std::vector<float>& d_weights) {
  const int64_t N = pass.rows(), E = pass.experts, K = pass.top_k;
  const double aux_scale = double(pass.loss_scale) * pass.aux_coef / double(pass.model_layers) *
                           double(E) / (double(N) * double(N));
  for (int64_t n = 0; n < N; ++n) {
    float* d = pass.d_probs.data() + n * E;
    for (int64_t e = 0; e < E; ++e)
      d[e] = float(aux_scale * double(saved.tokens_per_expert[size_t(e)]));
    const float* p = saved.probs.data() + n * E;
    float sum = 0, weighted = 0;
    for (int64_t k = 0; k < K; ++k) {
      sum += p[saved.selected[size_t(n * K + k)]];
      weighted += d_weights[size_t(n * K + k)] * saved.weights[size_t(n * K + k)];
    }
    for (int64_t k = 0; k < K; ++k) {
      d[saved.selected[size_t(n * K + k)]] += (d_weights[size_t(n * K + k)] - weighted) / sum;
    }
  }
}

// d_logits = p * (d_p - sum_e p_e d_p_e), in place of d_probs.
void softmax_backward_rows(float* d_probs, const float* probs, int64_t rows, int64_t experts) {
  for (int64_t n = 0; n < rows; ++n) {
    float* d = d_probs + n * experts;
    const float* p = probs + n * experts;
    float dot = 0;
    for (int64_t e = 0; e < experts; ++e) dot += d[e] * p[e];
    for (int64_t e = 0; e < experts; ++e) d[e] = p[e] * (d[e] - dot);
  }
}

}  // namespace

MoePass::MoePass(const MixtralConfig& c, int64_t batch, int64_t seq_len,
                 models::TensorParallelGroup& tp, bool sequence_parallel,
                 const models::ParallelBlocks& blocks, const models::ContextParallel& cp,
                 const models::ExpertParallel& expert_parallel)
    : DecoderPass(c, batch, seq_len, tp, sequence_parallel, blocks, cp),
      ep(expert_parallel.group != nullptr ? *expert_parallel.group : single),
      statistics(expert_parallel.statistics),
      experts(c.num_local_experts),
      top_k(c.num_experts_per_tok),
      local_experts(c.num_local_experts / ep.size()),
      first_expert(ep.rank() * local_experts),
      model_layers(c.num_hidden_layers),
      aux_coef(c.router_aux_loss_coef),
      slots(rows() * top_k * hidden),
      d_slots(rows() * top_k * hidden),
      d_weights(rows() * top_k),
      d_probs(rows() * experts),
      d_router_input(rows() * hidden) {
  models::require(experts % ep.size() == 0, Mixtral::kName,
                  "expert parallelism spreads num_local_experts = " + std::to_string(experts) +
                      " experts over " + std::to_string(ep.size()) +
                      " ep ranks, which do not divide them");
}

MoeActivations::MoeActivations(const MoePass& pass)
    : AttentionActivations(pass),
      norm2(pass.rows() * pass.hidden),
      rstd2(pass.rows()),
      probs(pass.rows() * pass.experts),
      selected(pass.rows() * pass.top_k),
      weights(pass.rows() * pass.top_k),
      slot_position(pass.rows() * pass.top_k),
      tokens_per_expert(pass.experts),
      send_counts(pass.ep.size()),
      recv_counts(pass.ep.size()),
      rows_from(pass.ep.size() * pass.local_experts),
      expert_outputs(pass.rows() * pass.top_k * pass.hidden),
      expert_in(pass.local_experts),
      gate_up(pass.local_experts),
      act(pass.local_experts) {}

int64_t MoeActivations::bytes() const {
  int64_t total = AttentionActivations::bytes() +
                  bytes_of(norm2, rstd2, probs, selected, weights, slot_position, tokens_per_expert,
                           send_counts, recv_counts, rows_from, expert_outputs);
  for (size_t j = 0; j < expert_in.size(); ++j) total += bytes_of(expert_in[j], gate_up[j], act[j]);
  return total;
}

// w1 and w3 act as one fused projection, as Llama's q, k, v do.
// The layer's views end with its experts' (this rank's only under ep).
void Mixtral::check_layer_storage(std::span<const ParameterView> layer, bool backward) {
  llama::check_attention_storage(layer.data(), backward);
  for (size_t i = kFirstExpert; i + 1 < layer.size(); i += kTensorsPerExpert) {
    const ParameterView& w1 = layer[i];
    if (w1.data + w1.numel != layer[i + 1].data ||
        (backward && w1.grad + w1.numel != layer[i + 1].grad)) {
      throw std::invalid_argument("mixtral: the host gave " + w1.name +
                                  " storage apart from its w3");
    }
  }
}

void Mixtral::check_tensor_parallel(const Config& /*config*/, int64_t tp,
                                    const models::ParallelBlocks& /*blocks*/) {
  models::require(tp == 1, kName,
                  "tensor parallelism: the Mixtral model computes its layers whole on each rank "
                  "(distributed.tp_size must be 1; spread the experts with ep_size)");
}

void Mixtral::layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                            LayerActivations& saved, float* out) {
  const int64_t N = pass.rows(), H = pass.hidden, K = pass.top_k;
  llama::attention_forward(pass, layer, x, saved);
  moe_input_norm(saved, layer, pass);
  linear_forward(saved.probs.data(), saved.norm2.data(), layer[kRouter].data, N, H, pass.experts);
  softmax_rows(saved.probs.data(), N, pass.experts);
  route(saved, pass);
  order_slots(saved, pass);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    std::copy_n(saved.norm2.begin() + (slot / K) * H, H,
                pass.slots.begin() + saved.slot_position[size_t(slot)] * H);
  }
  exchange_counts(saved, pass);
  pass.received.resize(size_t(received_floats(saved)));
  pass.ep.all_to_all(pass.slots.data(), saved.send_counts, pass.received.data(), saved.recv_counts);
  experts_forward(layer, saved, pass);
  pass.ep.all_to_all(pass.returned.data(), saved.recv_counts, saved.expert_outputs.data(),
                     saved.send_counts);
  std::copy_n(saved.h.begin(), N * H, out);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const float w = saved.weights[size_t(slot)];
    const float* y = saved.expert_outputs.data() + saved.slot_position[size_t(slot)] * H;
    float* row = out + (slot / K) * H;
    for (int64_t i = 0; i < H; ++i) row[i] += w * y[i];
  }
  saved.aux_loss = load_balancing_loss(saved, pass);
}

void Mixtral::layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, WeightGradients& gradients) {
  const int64_t N = pass.rows(), H = pass.hidden, K = pass.top_k, E = pass.experts;
  const float* d_out = pass.d_residual.data();
  std::vector<float>& d_weights = pass.d_weights;
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const int64_t at = saved.slot_position[size_t(slot)] * H;
    const float* dy = d_out + (slot / K) * H;
    const float* y = saved.expert_outputs.data() + at;
    const float w = saved.weights[size_t(slot)];
    float dot = 0;
    for (int64_t i = 0; i < H; ++i) {
      pass.d_slots[size_t(at + i)] = w * dy[i];
      dot += dy[i] * y[i];
    }
    d_weights[size_t(slot)] = dot;
  }
  pass.received.resize(size_t(received_floats(saved)));
  pass.ep.all_to_all(pass.d_slots.data(), saved.send_counts, pass.received.data(),
                     saved.recv_counts);
  experts_backward(layer, saved, pass, gradients);
  pass.ep.all_to_all(pass.returned.data(), saved.recv_counts, pass.slots.data(), saved.send_counts);
  std::fill(pass.d_norm.begin(), pass.d_norm.end(), 0.0f);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const float* dx = pass.slots.data() + saved.slot_position[size_t(slot)] * H;
    float* row = pass.d_norm.data() + (slot / K) * H;
    for (int64_t i = 0; i < H; ++i) row[i] += dx[i];
  }
  router_probability_gradient(saved, pass, d_weights);
  softmax_backward_rows(pass.d_probs.data(), saved.probs.data(), N, E);
  linear_backward_input(pass.d_router_input.data(), pass.d_probs.data(), layer[kRouter].data, N, H,
                        E);
  for (int64_t i = 0; i < N * H; ++i) pass.d_norm[size_t(i)] += pass.d_router_input[size_t(i)];
  gradients.linear({&layer[kRouter], &layer[kRouter], WeightLayout::out_in, N, H, E},
                   pass.d_probs.data(), saved.norm2);
  rmsnorm_backward(pass.d_residual.data(), layer[kPostNorm].grad, pass.d_norm.data(),
                   saved.h.data(), layer[kPostNorm].data, saved.rstd2.data(), N, H);
  gradients.vector_ready(layer[kPostNorm]);
  llama::attention_backward(pass, layer, x, saved, gradients);
  if (pass.statistics != nullptr) {
    pass.statistics->aux_loss += saved.aux_loss / double(pass.model_layers);
    pass.statistics->expert_tokens.resize(size_t(E), 0.0);
    for (int64_t e = 0; e < E; ++e) {
      pass.statistics->expert_tokens[size_t(e)] += double(saved.tokens_per_expert[size_t(e)]);
    }
  }
}

void Mixtral::recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                    LayerActivations& saved) {
  llama::attention_norm(pass, layer, x, saved);
  moe_input_norm(saved, layer, pass);
}

}  // namespace meshrun::mixtral
