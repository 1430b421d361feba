// One pipeline stage of the reference Llama: a contiguous range of decoder
// layers, with the embedding on the first stage and the final norm, lm_head
// and loss on the last (ANCHORS.md "Pipeline"). It runs the same kernels as
// LlamaModel (decoder.hpp), so a chain of stages computes what the model
// does.
//
// Parameters and gradients live in two flat buffers of the stage's own, in
// Hugging Face's order and names: the subset of LlamaModel's parameters the
// stage holds, so a host copies weights in by name and strategies bucket and
// shard over the stage's buffers as over the model's.
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

class LlamaStage {
 public:
  // Parameters zero. Throws std::invalid_argument for sizes the architecture
  // cannot take, a layout that does not fit the model or holds nothing, and
  // tied embeddings on a stage without both the embedding and the head.
  LlamaStage(LlamaConfig config, StageLayout layout);
  ~LlamaStage();
  LlamaStage(const LlamaStage&) = delete;
  LlamaStage& operator=(const LlamaStage&) = delete;
  LlamaStage(LlamaStage&&) noexcept;
  LlamaStage& operator=(LlamaStage&&) noexcept;

  const LlamaConfig& config() const { return config_; }
  const StageLayout& layout() const { return layout_; }
  // In buffer order: model.embed_tokens.weight (embedding); the layers'
  // tensors as in LlamaModel; model.norm.weight and lm_head.weight unless
  // tied (head).
  std::vector<ParameterView>& parameters() { return parameters_; }
  const std::vector<ParameterView>& parameters() const { return parameters_; }
  float* param_buffer() { return params_.data(); }
  float* grad_buffer() { return grads_.data(); }
  int64_t num_parameters() const { return num_parameters_; }
  void zero_grad();
  // Frees the parameter and gradient buffers and nulls the views: a sharded
  // strategy owns the storage from now on and the caller points the views
  // at it before each use (as LlamaModel::release_storage).
  void release_storage();

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
  float forward(int32_t mb, const int32_t* tokens, const int32_t* targets, const float* input,
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

  const ParameterView* layer_views(int64_t layer) const;
  int64_t layer_count() const { return layout_.end_layer - layout_.first_layer; }
  Microbatch& forwarded(int32_t mb, const char* action);
  void backward_pass(Microbatch& state, float loss_scale, const float* grad_output,
                     float* grad_input, WeightGradients& gradients);

  LlamaConfig config_;
  StageLayout layout_;
  std::vector<float> params_;
  std::vector<float> grads_;
  int64_t num_parameters_ = 0;
  std::vector<ParameterView> parameters_;
  int norm_index_ = 0;
  int lm_head_index_ = 0;
  std::unique_ptr<DecoderPass> pass_;
  std::map<int32_t, std::unique_ptr<Microbatch>> microbatches_;
};

}  // namespace meshrun::llama
