#include "common/mixture_of_experts.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/layers.hpp"
#include "common/support.hpp"

namespace meshrun::models {

using namespace kernels;

namespace {

enum ExpertTensor { kW1, kW3, kW2 };

const ParameterView& expert_view(const ParameterView* views, int64_t local, int64_t tensor) {
  return views[1 + local * kExpertTensors + tensor];
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
void route(MixtureActivations& saved, const MixtureShape& shape) {
  const int64_t N = shape.rows, E = shape.experts, K = shape.top_k;
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
void order_slots(MixtureActivations& saved, const MixtureScratch& scratch) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, E = shape.experts, K = shape.top_k, H = shape.hidden;
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
    saved.send_counts[size_t(e / scratch.local_experts)] += saved.tokens_per_expert[size_t(e)] * H;
  }
}

// Each rank tells each other how many rows it sends to each of their
// experts (the receivers' rows_from), then the rows go.
void exchange_counts(MixtureActivations& saved, MixtureScratch& scratch) {
  const int64_t ranks = scratch.ep.size(), El = scratch.local_experts, H = scratch.shape.hidden;
  std::vector<float> mine(saved.tokens_per_expert.begin(), saved.tokens_per_expert.end());
  std::vector<float> theirs(size_t(ranks * El));
  const std::vector<int64_t> each(size_t(ranks), El);
  scratch.ep.all_to_all(mine.data(), each, theirs.data(), each);
  std::fill(saved.recv_counts.begin(), saved.recv_counts.end(), 0);
  for (int64_t i = 0; i < ranks * El; ++i) {
    saved.rows_from[size_t(i)] = int64_t(theirs[size_t(i)]);
    saved.recv_counts[size_t(i / El)] += saved.rows_from[size_t(i)] * H;
  }
}

// The floats a dispatch brings this rank.
int64_t received_floats(const MixtureActivations& saved) {
  int64_t received = 0;
  for (const int64_t count : saved.recv_counts) received += count;
  return received;
}

// Visits the received rows of local expert j: (offset in the received
// buffer, offset in the expert's rows, rows), source rank by source rank.
template <class Visit>
void for_expert_rows(const MixtureActivations& saved, const MixtureScratch& scratch, int64_t j,
                     Visit&& visit) {
  const int64_t El = scratch.local_experts, H = scratch.shape.hidden;
  int64_t source_begin = 0, expert_row = 0;
  for (int64_t source = 0; source < scratch.ep.size(); ++source) {
    int64_t row = source_begin / H;
    for (int64_t i = 0; i < j; ++i) row += saved.rows_from[size_t(source * El + i)];
    const int64_t rows = saved.rows_from[size_t(source * El + j)];
    visit(row * H, expert_row * H, rows * H);
    expert_row += rows;
    source_begin += saved.recv_counts[size_t(source)];
  }
}

int64_t rows_of_expert(const MixtureActivations& saved, const MixtureScratch& scratch, int64_t j) {
  int64_t rows = 0;
  for (int64_t source = 0; source < scratch.ep.size(); ++source) {
    rows += saved.rows_from[size_t(source * scratch.local_experts + j)];
  }
  return rows;
}

// E / N sum_e tokens_e P_e, P_e the mean router probability of expert e
// (Hugging Face's load_balancing_loss_func on one layer).
double load_balancing_loss(const MixtureActivations& saved, const MixtureShape& shape) {
  const int64_t N = shape.rows, E = shape.experts;
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    double mean_prob = 0;
    for (int64_t n = 0; n < N; ++n) mean_prob += saved.probs[size_t(n * E + e)];
    loss += double(saved.tokens_per_expert[size_t(e)]) * mean_prob / double(N);
  }
  return loss * double(E) / double(N);
}

// The experts' forward on the rows they received: xin -> w2(silu(w1 x) * w3 x).
void experts_forward(const ParameterView* views, MixtureActivations& saved,
                     MixtureScratch& scratch) {
  const int64_t H = scratch.shape.hidden, I = scratch.shape.intermediate;
  scratch.returned.resize(scratch.received.size());
  for (int64_t j = 0; j < scratch.local_experts; ++j) {
    // Fresh buffers of the rows this forward routed here: a resize would
    // keep the most rows any earlier forward routed to the expert.
    const int64_t rows = rows_of_expert(saved, scratch, j);
    auto& in = saved.expert_in[size_t(j)];
    in = std::vector<float>(size_t(rows * H));
    saved.gate_up[size_t(j)] = std::vector<float>(size_t(rows * 2 * I));
    saved.act[size_t(j)] = std::vector<float>(size_t(rows * I));
    if (rows == 0) continue;
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(scratch.received.begin() + at, count, in.begin() + own);
    });
    linear_forward(saved.gate_up[size_t(j)].data(), in.data(),
                   weight_of(expert_view(views, j, kW1)), rows, H, 2 * I);
    swiglu_forward(saved.act[size_t(j)].data(), saved.gate_up[size_t(j)].data(), rows, I);
    scratch.expert_out.resize(size_t(rows * H));
    linear_forward(scratch.expert_out.data(), saved.act[size_t(j)].data(),
                   weight_of(expert_view(views, j, kW2)), rows, I, H);
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(scratch.expert_out.begin() + own, count, scratch.returned.begin() + at);
    });
  }
}

// The experts' backward from the gradients of their outputs
// (scratch.received, in received order) to those of their inputs
// (scratch.returned).
void experts_backward(const ParameterView* views, MixtureActivations& saved,
                      MixtureScratch& scratch, WeightGradients& gradients) {
  const int64_t H = scratch.shape.hidden, I = scratch.shape.intermediate;
  scratch.returned.resize(scratch.received.size());
  for (int64_t j = 0; j < scratch.local_experts; ++j) {
    const ParameterView& w1 = expert_view(views, j, kW1);
    const ParameterView& w3 = expert_view(views, j, kW3);
    const ParameterView& w2 = expert_view(views, j, kW2);
    const int64_t rows = rows_of_expert(saved, scratch, j);
    if (rows == 0) {
      for (const ParameterView* view : {&w2, &w3, &w1}) gradients.vector_ready(*view);
      continue;
    }
    scratch.expert_out.resize(size_t(rows * H));
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(scratch.received.begin() + at, count, scratch.expert_out.begin() + own);
    });
    scratch.d_act.resize(size_t(rows * I));
    scratch.d_gate_up.resize(size_t(rows * 2 * I));
    scratch.d_expert_in.resize(size_t(rows * H));
    linear_backward_input(scratch.d_act.data(), scratch.expert_out.data(), weight_of(w2), rows, I,
                          H);
    gradients.linear({&w2, &w2, WeightLayout::out_in, rows, I, H}, scratch.expert_out.data(),
                     saved.act[size_t(j)]);
    swiglu_backward(scratch.d_gate_up.data(), scratch.d_act.data(), saved.gate_up[size_t(j)].data(),
                    rows, I);
    linear_backward_input(scratch.d_expert_in.data(), scratch.d_gate_up.data(), weight_of(w1), rows,
                          H, 2 * I);
    gradients.linear({&w1, &w3, WeightLayout::out_in, rows, H, 2 * I}, scratch.d_gate_up.data(),
                     saved.expert_in[size_t(j)]);
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      std::copy_n(scratch.d_expert_in.begin() + own, count, scratch.returned.begin() + at);
    });
  }
}

// d_probs from the routing weights' gradients d_w (w_k = p_k / sum_S p):
// dp_m = (dw_m - sum_k dw_k w_k) / sum_S p for the selected m; and from the
// load-balancing loss, c d/dp of E / N sum_e tokens_e mean_n p_ne, the
// token counts taken as constants (as Hugging Face's loss does).
void router_probability_gradient(const MixtureActivations& saved, MixtureScratch& scratch,
                                 float loss_scale) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, E = shape.experts, K = shape.top_k;
  const double aux_scale = double(loss_scale) * shape.aux_coef / double(shape.model_layers) *
                           double(E) / (double(N) * double(N));
  for (int64_t n = 0; n < N; ++n) {
    float* d = scratch.d_probs.data() + n * E;
    for (int64_t e = 0; e < E; ++e)
      d[e] = float(aux_scale * double(saved.tokens_per_expert[size_t(e)]));
    const float* p = saved.probs.data() + n * E;
    const float* d_weights = scratch.d_weights.data() + n * K;
    float sum = 0, weighted = 0;
    for (int64_t k = 0; k < K; ++k) {
      sum += p[saved.selected[size_t(n * K + k)]];
      weighted += d_weights[k] * saved.weights[size_t(n * K + k)];
    }
    for (int64_t k = 0; k < K; ++k) {
      d[saved.selected[size_t(n * K + k)]] += (d_weights[k] - weighted) / sum;
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

void add_statistics(const MixtureActivations& saved, const MixtureScratch& scratch) {
  ExpertStatistics* statistics = scratch.statistics;
  if (statistics == nullptr) return;
  const int64_t E = scratch.shape.experts;
  statistics->aux_loss += saved.aux_loss / double(scratch.shape.model_layers);
  statistics->expert_tokens.resize(size_t(E), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    statistics->expert_tokens[size_t(e)] += double(saved.tokens_per_expert[size_t(e)]);
  }
}

}  // namespace

MixtureScratch::MixtureScratch(const MixtureShape& shape, const ExpertParallel& expert_parallel,
                               const char* model)
    : shape(shape),
      ep(expert_parallel.group != nullptr ? *expert_parallel.group : single),
      statistics(expert_parallel.statistics),
      local_experts(shape.experts / ep.size()),
      slots(size_t(shape.rows * shape.top_k * shape.hidden)),
      d_slots(size_t(shape.rows * shape.top_k * shape.hidden)),
      d_weights(size_t(shape.rows * shape.top_k)),
      d_probs(size_t(shape.rows * shape.experts)),
      d_router_input(size_t(shape.rows * shape.hidden)) {
  require(shape.experts % ep.size() == 0, model,
          "expert parallelism spreads " + std::to_string(shape.experts) + " experts over " +
              std::to_string(ep.size()) + " ep ranks, which do not divide them");
}

LowPrecisionBuffers low_precision(MixtureActivations& saved) {
  LowPrecisionBuffers buffers{&saved.expert_outputs};
  for (auto* experts : {&saved.expert_in, &saved.gate_up, &saved.act}) {
    for (std::vector<float>& buffer : *experts) buffers.push_back(&buffer);
  }
  return buffers;
}

MixtureActivations::MixtureActivations(const MixtureScratch& scratch)
    : probs(size_t(scratch.shape.rows * scratch.shape.experts)),
      selected(size_t(scratch.shape.rows * scratch.shape.top_k)),
      weights(size_t(scratch.shape.rows * scratch.shape.top_k)),
      slot_position(size_t(scratch.shape.rows * scratch.shape.top_k)),
      tokens_per_expert(size_t(scratch.shape.experts)),
      send_counts(size_t(scratch.ep.size())),
      recv_counts(size_t(scratch.ep.size())),
      rows_from(size_t(scratch.ep.size() * scratch.local_experts)),
      expert_outputs(size_t(scratch.shape.rows * scratch.shape.top_k * scratch.shape.hidden)),
      expert_in(size_t(scratch.local_experts)),
      gate_up(size_t(scratch.local_experts)),
      act(size_t(scratch.local_experts)) {}

int64_t MixtureActivations::bytes() const {
  int64_t total = bytes_of(probs, selected, weights, slot_position, tokens_per_expert, send_counts,
                           recv_counts, rows_from, expert_outputs);
  for (size_t j = 0; j < expert_in.size(); ++j) total += bytes_of(expert_in[j], gate_up[j], act[j]);
  return total;
}

void mixture_forward(MixtureScratch& scratch, const ParameterView* views, const float* x,
                     MixtureActivations& saved, float* y) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, H = shape.hidden, K = shape.top_k;
  linear_forward(saved.probs.data(), x, weight_of(views[0]), N, H, shape.experts);
  softmax_rows(saved.probs.data(), N, shape.experts);
  route(saved, shape);
  order_slots(saved, scratch);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    std::copy_n(x + (slot / K) * H, H,
                scratch.slots.begin() + saved.slot_position[size_t(slot)] * H);
  }
  exchange_counts(saved, scratch);
  scratch.received.resize(size_t(received_floats(saved)));
  scratch.ep.all_to_all(scratch.slots.data(), saved.send_counts, scratch.received.data(),
                        saved.recv_counts);
  experts_forward(views, saved, scratch);
  scratch.ep.all_to_all(scratch.returned.data(), saved.recv_counts, saved.expert_outputs.data(),
                        saved.send_counts);
  std::fill_n(y, N * H, 0.0f);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const float w = saved.weights[size_t(slot)];
    const float* expert_y = saved.expert_outputs.data() + saved.slot_position[size_t(slot)] * H;
    float* row = y + (slot / K) * H;
    for (int64_t i = 0; i < H; ++i) row[i] += w * expert_y[i];
  }
  saved.aux_loss = load_balancing_loss(saved, shape);
}

void mixture_backward(MixtureScratch& scratch, const ParameterView* views, const float* dy,
                      float loss_scale, MixtureActivations& saved, std::vector<float>& x_kept,
                      float* dx, WeightGradients& gradients) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, H = shape.hidden, K = shape.top_k, E = shape.experts;
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const int64_t at = saved.slot_position[size_t(slot)] * H;
    const float* d_row = dy + (slot / K) * H;
    const float* expert_y = saved.expert_outputs.data() + at;
    const float w = saved.weights[size_t(slot)];
    float dot = 0;
    for (int64_t i = 0; i < H; ++i) {
      scratch.d_slots[size_t(at + i)] = w * d_row[i];
      dot += d_row[i] * expert_y[i];
    }
    scratch.d_weights[size_t(slot)] = dot;
  }
  scratch.received.resize(size_t(received_floats(saved)));
  scratch.ep.all_to_all(scratch.d_slots.data(), saved.send_counts, scratch.received.data(),
                        saved.recv_counts);
  experts_backward(views, saved, scratch, gradients);
  scratch.ep.all_to_all(scratch.returned.data(), saved.recv_counts, scratch.slots.data(),
                        saved.send_counts);
  std::fill_n(dx, N * H, 0.0f);
  for (int64_t slot = 0; slot < N * K; ++slot) {
    const float* d_slot = scratch.slots.data() + saved.slot_position[size_t(slot)] * H;
    float* row = dx + (slot / K) * H;
    for (int64_t i = 0; i < H; ++i) row[i] += d_slot[i];
  }
  router_probability_gradient(saved, scratch, loss_scale);
  softmax_backward_rows(scratch.d_probs.data(), saved.probs.data(), N, E);
  linear_backward_input(scratch.d_router_input.data(), scratch.d_probs.data(), weight_of(views[0]),
                        N, H, E);
  for (int64_t i = 0; i < N * H; ++i) dx[i] += scratch.d_router_input[size_t(i)];
  gradients.linear({&views[0], &views[0], WeightLayout::out_in, N, H, E}, scratch.d_probs.data(),
                   x_kept);
  add_statistics(saved, scratch);
}

void check_mixture_storage(std::span<const ParameterView> views, bool backward, const char* model) {
  for (size_t i = 1; i + 1 < views.size(); i += kExpertTensors) {
    if (!adjacent_views(&views[i], &views[i + 1], backward)) {
      throw std::invalid_argument(std::string(model) + ": the host gave " + views[i].name +
                                  " storage apart from its w3");
    }
  }
}

}  // namespace meshrun::models
