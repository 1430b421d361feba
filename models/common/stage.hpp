// A stage of a shipped decoder-only family (Llama, GPT-2): a contiguous
// range of decoder layers, with the embedding on the first stage and the
// final norm, lm_head and loss ("the head") on the last. The whole model is
// the stage that holds everything. A stage owns no parameter storage: at
// every unit boundary it calls its StageHooks, which point the parameter
// views at storage the host keeps (meshrun/model.h).
//
// Several microbatches are in flight at once in a pipeline: forward(mb)
// keeps what mb's backward needs under the key mb until that backward is
// done, either at once (backward, "B") or split as zero-bubble schedules do
// into the input gradient (backward_input, "I") and the weight gradients
// (backward_weight, "W").
//
// Activation checkpointing: the forward of a fully recomputed layer keeps
// only its input, which the residual stream holds anyway, and its backward
// first runs the layer's forward again into one scratch shared by all such
// layers; a selective layer keeps its matmul outputs and recomputes the
// element-wise rest. The same inputs, parameters and ops give gradients
// bit-identical to keeping everything.
//
// TransformerStage<Family> is that driver; the family computes the pieces.
// A Family has (all static but the types):
//   Config, with vocab_size and tie_word_embeddings (Hugging Face names);
//     check_config(config); num_layers(config)
//   kName: the family's name, which messages begin with
//   parameters(config): every parameter in order, in DecoderUnits: the
//     layers' in units 0..L-1, the embedding's, the head's, a tied
//     embedding in the root;
//   init_parameter(config, parameters, seed, index, values): one's initial
//     values, independent of the others'
//   embedding_tensors(config): the views of the embedding (the first
//     parameters outside the layers; a tied lm_head is the first of them); a layer's views are
//     those of its unit the stage holds (all, or with expert parallelism
//     its own experts' only)
//   check_layer_storage(layer views (a span), backward): the host's storage
//     is fit
//   kSequenceParallel: whether it computes sequence parallelism
//   check_tensor_parallel(config, tp_size, blocks): the model splits its
//     parallel blocks over tp ranks (throws std::invalid_argument if not);
//     parameters() say each one's placement (ParameterView::tp)
//   tensor_parallel_blocks(): its BlockSpecs; tensor_parallel_block(config,
//     name): the Block of a parameter it computes over tp
//   Pass(config, batch, seq_len, tp, sequence_parallel, blocks, cp[, ep]): what a
//     forward at one shape shares (seq_len: the rank's rows of each
//     sequence, all of them without context parallelism, whose attention
//     and positions a SequenceAttention over cp computes), with local sizes
//     over the tp group for
//     the parallel blocks (common/tensor_parallel.hpp), stream_numel() (the elements of the
//     residual stream a rank holds: rows() * hidden, or its rows of them with
//     sequence parallelism; throws std::invalid_argument for sequence
//     parallelism the family cannot compute), and
//     rows() = batch * seq_len, hidden, and d_residual [rows, hidden], the
//     residual stream's gradient, and bfloat16_activations: set when the
//     stage keeps low_precision() in bfloat16, a layer's forward then
//     rounds each such buffer (as keeping it would) before an element-wise
//     op that selective checkpointing recomputes reads it, so that what it
//     recomputes is what it computed
//   LayerActivations(pass), HeadActivations(pass): what a layer's and the
//     head's forward keep for the backward; bytes()
//   elementwise(layer activations): the buffers recompute_elementwise
//     computes, the same vectors in the same order for any activations
//   low_precision(layer or head activations): the buffers a bfloat16 run
//     keeps in bfloat16 (common/kept_activations.hpp), the same vectors in
//     the same order for any activations
//   recompute_elementwise(pass, views, x, saved): those buffers again from
//     x and the rest of what layer_forward wrote
//   embedding_forward(pass, views, tokens, out);
//   embedding_backward(pass, views, tokens): from pass.d_residual
//   layer_forward(pass, views, x, saved, out);
//   layer_backward(pass, views, x, saved, gradients): pass.d_residual from
//     dL/d(out) to dL/dx
//   head_forward(pass, head views, lm_head, x, targets, saved): the mean loss;
//   head_backward(pass, head views, lm_head, x, targets, loss_scale, saved,
//     gradients): pass.d_residual = d(loss_scale * loss)/dx
// and optionally
//   kExperts: its layers are mixtures of experts: Pass takes the stage's
//     ExpertParallel (common/expert_parallel.hpp) last, and has loss_scale,
//     set before each backward (the layers' auxiliary losses need it)
//   kAnyCompute: it computes on any Compute (common/compute.hpp), not only
//     the host's: Pass takes the ExpertParallel and the stage's compute last,
//     and holds its buffers in the compute's memory (common/buffer.hpp)
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/buffer.hpp"
#include "common/compute.hpp"
#include "common/context_parallel.hpp"
#include "common/expert_parallel.hpp"
#include "common/kept_activations.hpp"
#include "common/layers.hpp"
#include "common/parameters.hpp"
#include "common/tensor_parallel.hpp"

namespace meshrun::models {

// Decoder layers [first_layer, end_layer), and whether the stage holds the
// embedding (the first stage: first_layer is 0) and the head (the last
// stage: end_layer is the layer count). A stage of the embedding or the
// head alone may hold no layer.
struct StageLayout {
  int64_t first_layer = 0;
  int64_t end_layer = 0;
  bool embedding = false;
  bool head = false;
};

// What the backward of a checkpointed layer computes again (the plan's
// activation_checkpointing "mode").
enum class Recomputation { full, selective };
// The model's checkpointed layers, by layer index.
using Checkpointing = std::map<int64_t, Recomputation>;

// The host's side of a stage (meshrun/model.h "Hooks"), with units and
// parameter indices as the family's parameters() numbers them.
class StageHooks {
 public:
  virtual ~StageHooks() = default;
  // `hidden` (numel floats) is the unit's input or output, null for the root.
  virtual void pre_forward(int64_t unit, float* hidden, int64_t numel) = 0;
  virtual void post_forward(int64_t unit, float* hidden, int64_t numel) = 0;
  virtual void pre_backward(int64_t unit) = 0;
  virtual void post_backward(int64_t unit) = 0;
  virtual void gradient_ready(int64_t parameter) = 0;
  // Points view.data, and view.grad when `backward`, at the parameter's
  // storage (valid until the unit's post_ hook).
  virtual void bind(ParameterView& view, bool backward) = 0;
};

// The view's values as the linears' GEMMs read them (layers.hpp, Weight).
inline kernels::Weight<float> weight_of(const ParameterView& view) {
  return {view.data, view.bfloat16};
}

// A linear's weight over a pass of `rows` rows: the adjacent views [first,
// last] (Llama's q/k/v and gate/up act as one fused projection), and where
// its gradient is computed.
struct LinearWeight {
  const ParameterView* first;
  const ParameterView* last;
  WeightLayout layout;
  int64_t rows, in, out;
  Compute* compute = &host_compute();
};

// dW += dy^T x into the weight's gradient, as its layout stores it.
void accumulate_weight_gradient(const LinearWeight& weight, const float* dy, const float* x);

// Where a backward sends the weight gradients it owes, so that one backward
// serves a full backward (computed at once, announced to hooks) and a
// pipeline's input-only backward (kept for a later weight pass).
class WeightGradients {
 public:
  virtual ~WeightGradients() = default;
  // The weight gradient of a linear: dy [rows, out] is scratch, valid during
  // the call; this is x's last use in the backward, so the receiver may move
  // it away.
  virtual void linear(const LinearWeight& weight, const float* dy, Buffer<float>& x) = 0;
  // The gradient of a vector parameter (a norm's weight or bias, a linear's
  // bias), computed along the input gradient as it is cheap, is final.
  virtual void vector_ready(const ParameterView& view) = 0;
};

// Computes each linear's weight gradient when it is owed; announces every
// gradient through ready(), last view first.
class ImmediateWeightGradients : public WeightGradients {
 public:
  void linear(const LinearWeight& weight, const float* dy, Buffer<float>& x) override;
  void vector_ready(const ParameterView& view) override { ready(view); }

 protected:
  virtual void ready(const ParameterView& /*view*/) {}
};

// The end of every family's head: logits [rows, V] = x [rows, H] lm_head^T
// (lm_head [V, H], nn.Linear's layout, or a tied embedding) and their mean
// natural-log cross-entropy against targets. Vocabulary-parallel over tp:
// lm_head and logits hold the rank's `vocab` shard. logits keep the softmax
// for the backward.
double lm_head_loss_forward(float* logits, const float* x, const ParameterView& lm_head,
                            const int32_t* targets, int64_t rows, int64_t hidden,
                            const VocabShard& vocab, TensorParallelGroup& tp,
                            Compute& compute = host_compute());
// dx = d(loss_scale * loss)/dx, through logits (overwritten with their
// gradient): the rank's partial sum over its vocabulary shard, which the
// caller sums over tp (all-reduce, or reduce-scatter with sequence
// parallelism); lm_head's weight gradient goes to `gradients`, which may
// take x.
void lm_head_loss_backward(float* dx, float* logits, const ParameterView& lm_head, Buffer<float>& x,
                           const int32_t* targets, float loss_scale, int64_t rows, int64_t hidden,
                           const VocabShard& vocab, WeightGradients& gradients,
                           Compute& compute = host_compute());

// Throws std::invalid_argument(family + ": " + message) unless condition.
void require(bool condition, const char* family, const std::string& message);

template <class Family>
class TransformerStage {
 public:
  using Config = typename Family::Config;

  // Throws std::invalid_argument for a configuration check_config refuses,
  // a layout that does not fit the model or holds nothing, tied embeddings
  // on a stage without both the embedding and the head, a checkpointed
  // layer outside the model (those of other stages are ignored), and, over
  // a tp group of more than one rank, a model check_tensor_parallel refuses
  // or `placements` (the plan's, by name) that differ from the family's.
  // `hooks`, `tp` (null: one rank) and cp's group must outlive the stage.
  // Over ep ranks (a family with kExperts) the stage holds its own experts'
  // parameters only.
  // Over cp ranks every forward gets the whole sequences and computes the
  // rank's rows of them (common/context_parallel.hpp); its loss is the mean
  // over all rows, its gradients those of the rank's rows' mean, which the
  // strategy's average over dp_shard_cp makes the micro-batch's.
  // With `bfloat16_activations` (a run whose matmuls compute in bfloat16)
  // the layers and the head keep their activations in bfloat16
  // (common/kept_activations.hpp).
  // `compute` (which must outlive the stage) computes the layers and holds
  // the stage's activations, its scratch and what it keeps between calls;
  // the pointers handed to the stage (tokens and targets too) and the
  // parameter views the hooks bind are of its memory.
  // A family computes on the host's only unless it has kAnyCompute (throws
  // std::invalid_argument).
  TransformerStage(Config config, StageLayout layout, StageHooks& hooks,
                   const Checkpointing& checkpointing = {}, TensorParallelGroup* tp = nullptr,
                   const Placements& placements = {}, const ContextParallel& cp = {},
                   const ExpertParallel& ep = {}, bool bfloat16_activations = false,
                   Compute& compute = host_compute());
  ~TransformerStage();
  TransformerStage(const TransformerStage&) = delete;
  TransformerStage& operator=(const TransformerStage&) = delete;

  const Config& config() const { return config_; }
  const StageLayout& layout() const { return layout_; }
  // The stage's parameters in model order: the embedding's, the layers',
  // the head's (its lm_head unless tied).
  const std::vector<ParameterView>& parameters() const { return parameters_; }

  // The microbatch shape [batch, seq_len] of the forwards to come; throws
  // std::logic_error to change it while microbatches are in flight.
  void set_shape(int64_t batch, int64_t seq_len);
  // Elements of the hidden states [batch * seq_len / cp, hidden] entering the
  // stage (0 with the embedding) and leaving it (0 with the head).
  int64_t input_numel() const;
  int64_t output_numel() const;

  // F: the forward of microbatch `mb`. tokens [batch, seq_len] with the
  // embedding, else `input` (input_numel()); targets with the head, else it
  // writes `output` (output_numel()); the other pointers are ignored.
  // Returns mb's mean loss with the head, else 0. Throws std::logic_error
  // before set_shape or for a microbatch already in flight,
  // std::invalid_argument for a missing pointer, std::out_of_range for a
  // token or target outside the vocabulary.
  double forward(int32_t mb, const int32_t* tokens, const int32_t* targets, const float* input,
                 float* output);
  // B: accumulates (+=) mb's weight gradients and writes grad_input (without
  // the embedding) from grad_output (without the head) or, with the head,
  // from loss_scale * the loss: loss_scale is d(objective)/d(mb's mean
  // loss), e.g. 1/m for the mean over m microbatches. Frees mb's state.
  void backward(int32_t mb, float loss_scale, const float* grad_output, float* grad_input);
  // I: as backward, but of the parameter gradients only the vectors' and
  // the embedding's (cheap); keeps each linear's output gradient and input
  // for W and frees the rest of mb's state.
  void backward_input(int32_t mb, float loss_scale, const float* grad_output, float* grad_input);
  // W: accumulates every linear's weight gradient that mb's backward_input
  // kept, then frees mb's state.
  void backward_weight(int32_t mb);

  // Drops what mb's forward kept, without a backward: a forward that only
  // evaluates. Throws std::logic_error when mb is not in flight.
  void discard(int32_t mb);
  // Bytes of the state kept for the microbatches in flight, with the
  // recompute scratch while any is: 0 once each has finished its backward.
  // Not the float32 buffers lent to a layer's compute when it keeps its
  // activations in bfloat16: like the pass's gradient buffers, they hold
  // nothing between calls.
  int64_t activation_bytes() const;

 private:
  static constexpr bool kAnyCompute = requires { Family::kAnyCompute; };
  struct Microbatch;
  struct Scratch;
  class AnnouncedGradients;
  class DeferredGradients;

  ParameterView* layer_views(int64_t layer);
  // The views of one of the stage's layers, from layer_views(layer) to the
  // next layer's or the head's.
  std::span<const ParameterView> layer_view_span(int64_t layer) const;
  int64_t layer_count() const { return layout_.end_layer - layout_.first_layer; }
  DecoderUnits units() const { return DecoderUnits(Family::num_layers(config_)); }
  // The root encloses the units of a stage with the embedding or the head,
  // whether or not it holds a parameter (a tied embedding) of its own.
  bool holds_root() const { return layout_.embedding || layout_.head; }
  // Whether the stage holds a parameter of `unit`.
  bool holds_unit(int64_t unit) const;
  void check_layout() const;
  void check_checkpointing(const Checkpointing& checkpointing) const;
  void localize(const Placements& placements);
  void select_parameters();
  // The hooks' pre_ call of `unit`, then its views pointed at its storage.
  void enter(int64_t unit, float* hidden, bool backward);
  // The embedding's or the head's unit entered and left around `compute`,
  // when the stage holds a parameter of it.
  template <class Compute>
  void in_unit(int64_t unit, bool backward, Compute&& compute);
  // This rank's rows of `full` [batch, seq_len] tokens (the compute's
  // memory), checked, in `local`.
  void take_rows(const int32_t* full, Buffer<int32_t>& local, const char* what) const;
  std::string microbatch_name(int32_t mb) const;
  // The mean of the cp ranks' losses, summed in the compute's memory (where
  // the cp group moves values).
  double context_parallel_mean(double loss);
  Microbatch& forwarded(int32_t mb, const char* action);
  // Stage layer i's activations: the microbatch's own, or the scratch of a
  // fully recomputed layer.
  typename Family::LayerActivations& activations(Microbatch& state, int64_t i);
  // What stage layer i keeps in bfloat16 (none when it keeps nothing);
  // the head's.
  LowPrecisionBuffers low_precision(Microbatch& state, int64_t i);
  LowPrecisionBuffers low_precision_head(Microbatch& state);
  // Stage layer i's forward and backward, its views bound; the backward
  // recomputes what the forward did not keep, unless the scratch still
  // holds it.
  void forward_layer(Microbatch& state, int64_t i, float* output);
  void backward_layer(Microbatch& state, int64_t i, WeightGradients& gradients);
  // A split backward moves inputs of the linears out of what it reads into
  // its pending weight pass: the scratch gets them back.
  void restore_scratch();
  void backward_pass(Microbatch& state, float loss_scale, const float* grad_output,
                     float* grad_input, WeightGradients& gradients, bool weights_deferred);
  // gradient_ready of the embedding's views, last first; a tied lm_head's
  // view waits for the weight pass when `skip_lm_head`.
  void announce_embedding(bool skip_lm_head);
  // A microbatch's state for a forward: a finished one's, else a new one.
  std::unique_ptr<Microbatch> take_state();
  // Ends microbatch `found`, keeping its forward state for the next forward.
  void finish(typename std::map<int32_t, std::unique_ptr<Microbatch>>::iterator found);

  Config config_;
  StageLayout layout_;
  StageHooks& hooks_;
  Compute& compute_;
  SingleRank single_rank_{compute_};
  TensorParallelGroup& tp_;
  bool sequence_parallel_;
  ContextParallel cp_;
  ExpertParallel ep_;
  ParallelBlocks blocks_;  // which blocks the plan computes over tp
  std::vector<ParameterView> parameters_;
  std::vector<int64_t> layer_first_view_;  // per stage layer, into parameters_
  int64_t head_index_ = 0;                 // into parameters_: the head's first view
  int64_t lm_head_index_ = 0;              // the embedding's first view when tied
  int64_t batch_ = 0, seq_len_ = 0;
  std::unique_ptr<typename Family::Pass> pass_;
  std::vector<std::optional<Recomputation>> checkpointed_;  // per stage layer
  std::unique_ptr<Scratch> scratch_;  // of the current shape, with any layer checkpointed
  bool bfloat16_activations_;
  // The float32 buffers lent to the layers and the head that keep their
  // activations in bfloat16, of the current shape.
  std::optional<KeptInBfloat16> kept_layer_, kept_head_;
  std::map<int32_t, std::unique_ptr<Microbatch>> microbatches_;
  // The states of finished microbatches, of the current shape: a forward
  // reuses one rather than allocating and zeroing the activations again.
  std::vector<std::unique_ptr<Microbatch>> spare_;
};

}  // namespace meshrun::models
