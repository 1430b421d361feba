// A sparse mixture of SwiGLU experts (Hugging Face's MixtralSparseMoeBlock),
// the one copy the hand-written Mixtral family and the model kit's MOE_MLP
// op compute with:
//
//   probs = softmax(x gate^T)                       [N, E]
//   S     = the top_k experts of each row (ties to the lower expert)
//   y     = sum over e in S of probs_e / sum_S probs * w2_e(silu(w1_e x) * w3_e x)
//
// Dropless, as Mixtral is: every expert takes every row routed to it. The
// experts live over the ep ranks (expert e on rank e * ep / E, common/
// expert_parallel.hpp): a row goes to its experts' ranks and comes back by
// two all-to-alls each way. The router's load-balancing loss
// (router_aux_loss_coef / layers x Hugging Face's load_balancing_loss_func
// on this layer's rows) joins the objective through the backward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/expert_parallel.hpp"
#include "common/parameters.hpp"
#include "common/stage.hpp"

namespace meshrun::models {

// A mixture's views: the router (gate) [E, H], then w1 [I, H], w3 [I, H]
// and w2 [H, I] of each expert the rank holds, w1 and w3 adjacent (they act
// as one [2I, H] projection).
inline constexpr int64_t kExpertTensors = 3;
inline int64_t mixture_views(int64_t local_experts) { return 1 + kExpertTensors * local_experts; }

struct MixtureShape {
  int64_t rows = 0, hidden = 0, intermediate = 0, experts = 0, top_k = 0;
  int64_t model_layers = 1;  // the load-balancing loss is the mean over the model's layers
  double aux_coef = 0;
};

// What every mixture of a pass shares: the sizes, the ep group, where the
// router statistics go, and the scratch of dispatch and combine.
struct MixtureScratch {
  // Throws std::invalid_argument (message beginning with `model`) when the
  // ep ranks do not divide the experts. The mixture computes on `compute`
  // (which must outlive it); its all-to-alls and counts are the host's.
  MixtureScratch(const MixtureShape& shape, const ExpertParallel& expert_parallel,
                 const char* model, Compute& compute = host_compute());
  MixtureScratch(const MixtureScratch&) = delete;
  MixtureScratch& operator=(const MixtureScratch&) = delete;
  int64_t views() const { return mixture_views(local_experts); }

  MixtureShape shape;
  Compute& compute;
  SingleExpertRank single{compute};
  ExpertParallelGroup& ep;
  ExpertStatistics* statistics;
  int64_t local_experts;
  // [N * top_k, H]: rows in dispatch order (sent, or their gradients).
  Buffer<float> slots, d_slots;
  // Rows as the experts receive them, and what they send back.
  Buffer<float> received{compute}, returned{compute};
  Buffer<float> d_weights;                // the routing weights' gradients [N, top_k]
  Buffer<float> d_probs, d_router_input;  // [N, E], [N, H]
  // one expert's rows
  Buffer<float> expert_out{compute}, d_expert_in{compute}, d_act{compute}, d_gate_up{compute};
};

// What a mixture's forward keeps for its backward: the routing's counts in
// host memory, the rest in the compute's.
struct MixtureActivations {
  explicit MixtureActivations(const MixtureScratch& scratch);
  int64_t bytes() const;

  Buffer<float> probs;            // the router's softmax [N, E]
  Buffer<int32_t> selected;       // the experts picked [N, top_k], in descending probability
  Buffer<float> weights;          // their renormalized probabilities [N, top_k]
  Buffer<int64_t> slot_position;  // of token n's k-th slot in dispatch order [N * top_k]
  std::vector<int64_t> tokens_per_expert;  // this rank's slots routed to each expert [E]
  // Floats sent to / received from each ep rank, and rows each source rank
  // sent to each local expert [ep * local_experts].
  std::vector<int64_t> send_counts, recv_counts, rows_from;
  Buffer<float> expert_outputs;  // the experts' outputs in dispatch order [N * top_k, H]
  // Per local expert: its input rows, w1 and w3's output, silu(w1 x) * w3 x.
  std::vector<Buffer<float>> expert_in, gate_up, act;
  double aux_loss = 0;  // this layer's load-balancing loss
};

// What a bfloat16 run keeps of a mixture in bfloat16
// (common/kept_activations.hpp): the experts' inputs, projections and
// outputs, not the router's probabilities and weights.
LowPrecisionBuffers low_precision(MixtureActivations& saved);

// y [N, H] = the mixture of x [N, H].
void mixture_forward(MixtureScratch& scratch, const ParameterView* views, const float* x,
                     MixtureActivations& saved, float* y);

// dx [N, H] = dL/dx from dy = dL/dy, with the load-balancing loss's
// gradient (loss_scale x router_aux_loss_coef / layers x its gradient)
// through the router; the experts' and the router's weight gradients to
// `gradients` (the router's reads x_kept, x's values, which it may move
// away). Adds the layer's load-balancing loss and tokens to the statistics.
void mixture_backward(MixtureScratch& scratch, const ParameterView* views, const float* dy,
                      float loss_scale, MixtureActivations& saved, Buffer<float>& x_kept, float* dx,
                      WeightGradients& gradients);

// Throws std::invalid_argument("<model>: ...") unless each expert's w1 and
// w3 lie one after another in the host's storage.
void check_mixture_storage(std::span<const ParameterView> views, bool backward, const char* model);

}  // namespace meshrun::models
