#include "common/mixture_of_experts.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/layers.hpp"
#include "common/support.hpp"

namespace meshrun::models {

namespace {

enum ExpertTensor { kW1, kW3, kW2 };

const ParameterView& expert_view(const ParameterView* views, int64_t local, int64_t tensor) {
  return views[1 + local * kExpertTensors + tensor];
}

// Dispatch order: the slots grouped by expert (so by the experts' ranks),
// tokens in order within an expert; the counts each rank sends.
void order_slots(MixtureActivations& saved, MixtureScratch& scratch) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, E = shape.experts, K = shape.top_k, H = shape.hidden;
  scratch.compute.moe_order_slots(saved.tokens_per_expert.data(), saved.slot_position.data(),
                                  saved.selected.data(), N, E, K);
  std::fill(saved.send_counts.begin(), saved.send_counts.end(), 0);
  for (int64_t e = 0; e < E; ++e) {
    saved.send_counts[size_t(e / scratch.local_experts)] += saved.tokens_per_expert[size_t(e)] * H;
  }
}

// The counts `mine` [ranks * El] through the ep group's all-to-all, which
// moves the compute's memory: each rank gets El from each.
std::vector<float> all_to_all_counts(const std::vector<float>& mine, MixtureScratch& scratch) {
  const auto bytes = int64_t(mine.size() * sizeof(float));
  Buffer<float> sent(mine.size(), scratch.compute), received(mine.size(), scratch.compute);
  scratch.compute.copy_from_host(sent.data(), mine.data(), bytes);
  const std::vector<int64_t> each(size_t(scratch.ep.size()), scratch.local_experts);
  scratch.ep.all_to_all(sent.data(), each, received.data(), each);
  std::vector<float> theirs(mine.size());
  scratch.compute.copy_to_host(theirs.data(), received.data(), bytes);
  return theirs;
}

// Each rank tells each other how many rows it sends to each of their
// experts (the receivers' rows_from), then the rows go. The counts are host
// memory; one rank keeps its own.
void exchange_counts(MixtureActivations& saved, MixtureScratch& scratch) {
  const int64_t ranks = scratch.ep.size(), El = scratch.local_experts, H = scratch.shape.hidden;
  const std::vector<float> mine(saved.tokens_per_expert.begin(), saved.tokens_per_expert.end());
  const std::vector<float> theirs = ranks > 1 ? all_to_all_counts(mine, scratch) : mine;
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
double load_balancing_loss(const MixtureActivations& saved, MixtureScratch& scratch) {
  const int64_t N = scratch.shape.rows, E = scratch.shape.experts;
  std::vector<double> probability_sums(static_cast<size_t>(E));
  scratch.compute.column_sums(probability_sums.data(), saved.probs.data(), N, E);
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    loss += double(saved.tokens_per_expert[size_t(e)]) * probability_sums[size_t(e)] / double(N);
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
    Compute& compute = scratch.compute;
    in = Buffer<float>(size_t(rows * H), compute);
    saved.gate_up[size_t(j)] = Buffer<float>(size_t(rows * 2 * I), compute);
    saved.act[size_t(j)] = Buffer<float>(size_t(rows * I), compute);
    if (rows == 0) continue;
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      compute.copy(in.data() + own, scratch.received.data() + at, count);
    });
    compute.linear_forward(WeightLayout::out_in, saved.gate_up[size_t(j)].data(), in.data(),
                           weight_of(expert_view(views, j, kW1)), rows, H, 2 * I);
    compute.swiglu_forward(saved.act[size_t(j)].data(), saved.gate_up[size_t(j)].data(), rows, I);
    scratch.expert_out.resize(size_t(rows * H));
    compute.linear_forward(WeightLayout::out_in, scratch.expert_out.data(),
                           saved.act[size_t(j)].data(), weight_of(expert_view(views, j, kW2)), rows,
                           I, H);
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      compute.copy(scratch.returned.data() + at, scratch.expert_out.data() + own, count);
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
    Compute& compute = scratch.compute;
    scratch.expert_out.resize(size_t(rows * H));
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      compute.copy(scratch.expert_out.data() + own, scratch.received.data() + at, count);
    });
    scratch.d_act.resize(size_t(rows * I));
    scratch.d_gate_up.resize(size_t(rows * 2 * I));
    scratch.d_expert_in.resize(size_t(rows * H));
    compute.linear_backward_input(WeightLayout::out_in, scratch.d_act.data(),
                                  scratch.expert_out.data(), weight_of(w2), rows, I, H);
    gradients.linear({&w2, &w2, WeightLayout::out_in, rows, I, H, &compute},
                     scratch.expert_out.data(), saved.act[size_t(j)]);
    compute.swiglu_backward(scratch.d_gate_up.data(), scratch.d_act.data(),
                            saved.gate_up[size_t(j)].data(), rows, I);
    compute.linear_backward_input(WeightLayout::out_in, scratch.d_expert_in.data(),
                                  scratch.d_gate_up.data(), weight_of(w1), rows, H, 2 * I);
    gradients.linear({&w1, &w3, WeightLayout::out_in, rows, H, 2 * I, &compute},
                     scratch.d_gate_up.data(), saved.expert_in[size_t(j)]);
    for_expert_rows(saved, scratch, j, [&](int64_t at, int64_t own, int64_t count) {
      compute.copy(scratch.returned.data() + at, scratch.d_expert_in.data() + own, count);
    });
  }
}

// d_probs from the routing weights' gradients and from the load-balancing
// loss, c d/dp of E / N sum_e tokens_e mean_n p_ne, the token counts taken
// as constants (as Hugging Face's loss does): c E / N^2 tokens_e for every
// row (common/experts.hpp, moe_router_gradient).
void router_probability_gradient(const MixtureActivations& saved, MixtureScratch& scratch,
                                 float loss_scale) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, E = shape.experts, K = shape.top_k;
  const double aux_scale = double(loss_scale) * shape.aux_coef / double(shape.model_layers) *
                           double(E) / (double(N) * double(N));
  std::vector<float> aux_per_token(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    aux_per_token[size_t(e)] = float(aux_scale * double(saved.tokens_per_expert[size_t(e)]));
  }
  scratch.compute.moe_router_gradient(scratch.d_probs.data(), aux_per_token.data(),
                                      saved.probs.data(), saved.selected.data(),
                                      saved.weights.data(), scratch.d_weights.data(), N, E, K);
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
                               const char* model, Compute& compute)
    : shape(shape),
      compute(compute),
      ep(expert_parallel.group != nullptr ? *expert_parallel.group : single),
      statistics(expert_parallel.statistics),
      local_experts(shape.experts / ep.size()),
      slots(size_t(shape.rows * shape.top_k * shape.hidden), compute),
      d_slots(size_t(shape.rows * shape.top_k * shape.hidden), compute),
      d_weights(size_t(shape.rows * shape.top_k), compute),
      d_probs(size_t(shape.rows * shape.experts), compute),
      d_router_input(size_t(shape.rows * shape.hidden), compute) {
  require(shape.experts % ep.size() == 0, model,
          "expert parallelism spreads " + std::to_string(shape.experts) + " experts over " +
              std::to_string(ep.size()) + " ep ranks, which do not divide them");
}

LowPrecisionBuffers low_precision(MixtureActivations& saved) {
  LowPrecisionBuffers buffers{&saved.expert_outputs};
  for (auto* experts : {&saved.expert_in, &saved.gate_up, &saved.act}) {
    for (Buffer<float>& buffer : *experts) buffers.push_back(&buffer);
  }
  return buffers;
}

MixtureActivations::MixtureActivations(const MixtureScratch& scratch)
    : probs(size_t(scratch.shape.rows * scratch.shape.experts), scratch.compute),
      selected(size_t(scratch.shape.rows * scratch.shape.top_k), scratch.compute),
      weights(size_t(scratch.shape.rows * scratch.shape.top_k), scratch.compute),
      slot_position(size_t(scratch.shape.rows * scratch.shape.top_k), scratch.compute),
      tokens_per_expert(size_t(scratch.shape.experts)),
      send_counts(size_t(scratch.ep.size())),
      recv_counts(size_t(scratch.ep.size())),
      rows_from(size_t(scratch.ep.size() * scratch.local_experts)),
      expert_outputs(size_t(scratch.shape.rows * scratch.shape.top_k * scratch.shape.hidden),
                     scratch.compute) {
  for (int64_t j = 0; j < scratch.local_experts; ++j) {
    expert_in.emplace_back(scratch.compute);
    gate_up.emplace_back(scratch.compute);
    act.emplace_back(scratch.compute);
  }
}

int64_t MixtureActivations::bytes() const {
  int64_t total = bytes_of(probs, selected, weights, slot_position, tokens_per_expert, send_counts,
                           recv_counts, rows_from, expert_outputs);
  for (size_t j = 0; j < expert_in.size(); ++j) total += bytes_of(expert_in[j], gate_up[j], act[j]);
  return total;
}

void mixture_forward(MixtureScratch& scratch, const ParameterView* views, const float* x,
                     MixtureActivations& saved, float* y) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, H = shape.hidden, K = shape.top_k, E = shape.experts;
  Compute& compute = scratch.compute;
  compute.linear_forward(WeightLayout::out_in, saved.probs.data(), x, weight_of(views[0]), N, H, E);
  compute.softmax_rows(saved.probs.data(), N, E);
  compute.moe_route(saved.selected.data(), saved.weights.data(), saved.probs.data(), N, E, K);
  order_slots(saved, scratch);
  compute.moe_dispatch(scratch.slots.data(), x, saved.slot_position.data(), N, K, H);
  exchange_counts(saved, scratch);
  scratch.received.resize(size_t(received_floats(saved)));
  scratch.ep.all_to_all(scratch.slots.data(), saved.send_counts, scratch.received.data(),
                        saved.recv_counts);
  experts_forward(views, saved, scratch);
  scratch.ep.all_to_all(scratch.returned.data(), saved.recv_counts, saved.expert_outputs.data(),
                        saved.send_counts);
  compute.moe_combine(y, saved.expert_outputs.data(), saved.weights.data(),
                      saved.slot_position.data(), N, K, H);
  saved.aux_loss = load_balancing_loss(saved, scratch);
}

void mixture_backward(MixtureScratch& scratch, const ParameterView* views, const float* dy,
                      float loss_scale, MixtureActivations& saved, Buffer<float>& x_kept, float* dx,
                      WeightGradients& gradients) {
  const MixtureShape& shape = scratch.shape;
  const int64_t N = shape.rows, H = shape.hidden, K = shape.top_k, E = shape.experts;
  Compute& compute = scratch.compute;
  compute.moe_combine_backward(scratch.d_slots.data(), scratch.d_weights.data(), dy,
                               saved.expert_outputs.data(), saved.weights.data(),
                               saved.slot_position.data(), N, K, H);
  scratch.received.resize(size_t(received_floats(saved)));
  scratch.ep.all_to_all(scratch.d_slots.data(), saved.send_counts, scratch.received.data(),
                        saved.recv_counts);
  experts_backward(views, saved, scratch, gradients);
  scratch.ep.all_to_all(scratch.returned.data(), saved.recv_counts, scratch.slots.data(),
                        saved.send_counts);
  compute.moe_dispatch_backward(dx, scratch.slots.data(), saved.slot_position.data(), N, K, H);
  router_probability_gradient(saved, scratch, loss_scale);
  compute.softmax_rows_backward(scratch.d_probs.data(), saved.probs.data(), N, E);
  compute.linear_backward_input(WeightLayout::out_in, scratch.d_router_input.data(),
                                scratch.d_probs.data(), weight_of(views[0]), N, H, E);
  compute.accumulate(dx, scratch.d_router_input.data(), N * H);
  gradients.linear({&views[0], &views[0], WeightLayout::out_in, N, H, E, &compute},
                   scratch.d_probs.data(), x_kept);
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
