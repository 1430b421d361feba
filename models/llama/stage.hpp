// A stage of the Llama model: a contiguous range of decoder layers, with the
// embedding on the first stage and the final norm, lm_head and loss on the
// last. The whole model is the stage that holds everything. A stage owns no
// parameter storage: at every unit boundary it calls its StageHooks, which
// point the parameter views at storage the host keeps (meshrun/model.h).
//
// Several microbatches are in flight at once in a pipeline: forward(mb)
// keeps what mb's backward needs under the key mb until that backward is
// done, either at once (backward, "B") or split as zero-bubble schedules do
// into the input gradient (backward_input, "I") and the weight gradients
// (backward_weight, "W").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "llama/model.hpp"

namespace meshrun::llama {

struct DecoderPass;
class WeightGradients;

// Decoder layers [first_layer, end_layer), and whether the stage holds the
// embedding (the first stage: first_layer is 0) and the head, that is
// model.norm, lm_head and the loss (the last stage: end_layer is
// num_hidden_layers). A stage of the embedding or the head alone may hold
// no layer.
struct StageLayout {
  int64_t first_layer = 0;
  int64_t end_layer = 0;
  bool embedding = false;
  bool head = false;
};

// The host's side of a stage (meshrun/model.h "Hooks"), with units and
// parameter indices as model.hpp numbers them.
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

class LlamaStage {
 public:
  // Throws std::invalid_argument for a configuration check_config refuses,
  // a layout that does not fit the model or holds nothing, and tied
  // embeddings on a stage without both the embedding and the head. `hooks`
  // must outlive the stage.
  LlamaStage(LlamaConfig config, StageLayout layout, StageHooks& hooks);
  ~LlamaStage();
  LlamaStage(const LlamaStage&) = delete;
  LlamaStage& operator=(const LlamaStage&) = delete;

  const LlamaConfig& config() const { return config_; }
  const StageLayout& layout() const { return layout_; }
  // In model order: model.embed_tokens.weight (embedding); the layers'
  // tensors; model.norm.weight and lm_head.weight unless tied (head).
  const std::vector<ParameterView>& parameters() const { return parameters_; }

  // The microbatch shape [batch, seq_len] of the forwards to come; throws
  // std::logic_error to change it while microbatches are in flight.
  void set_shape(int64_t batch, int64_t seq_len);
  // Elements of the hidden states [batch * seq_len, hidden_size] entering
  // the stage (0 with the embedding) and leaving it (0 with the head).
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
  // I: as backward, but of the weight gradients only the norms' and the
  // embedding's (cheap); keeps each linear's output gradient and input for W
  // and frees the rest of mb's state.
  void backward_input(int32_t mb, float loss_scale, const float* grad_output, float* grad_input);
  // W: accumulates every linear's weight gradient (dW += dy^T x) that mb's
  // backward_input kept, then frees mb's state.
  void backward_weight(int32_t mb);

  // Drops what mb's forward kept, without a backward: a forward that only
  // evaluates. Throws std::logic_error when mb is not in flight.
  void discard(int32_t mb);
  // Bytes of the state kept for the microbatches in flight: 0 once each
  // has finished its backward.
  int64_t activation_bytes() const;

 private:
  struct Microbatch;
  class AnnouncedGradients;

  ParameterView* layer_views(int64_t layer);
  int64_t layer_count() const { return layout_.end_layer - layout_.first_layer; }
  bool holds_root() const { return layout_.embedding || layout_.head; }
  // The hooks' pre_ call of `unit`, then its views pointed at its storage.
  void enter(int64_t unit, float* hidden, bool backward);
  Microbatch& forwarded(int32_t mb, const char* action);
  void backward_pass(Microbatch& state, float loss_scale, const float* grad_output,
                     float* grad_input, WeightGradients& gradients);

  LlamaConfig config_;
  StageLayout layout_;
  StageHooks& hooks_;
  std::vector<ParameterView> parameters_;
  int embed_index_ = -1;  // into parameters_, -1 without the embedding
  int norm_index_ = 0;
  int lm_head_index_ = 0;
  std::unique_ptr<DecoderPass> pass_;
  std::map<int32_t, std::unique_ptr<Microbatch>> microbatches_;
};

}  // namespace meshrun::llama
