// The reference Llama model on the CPU: exactly Hugging Face's
// LlamaForCausalLM (embedding; per layer h = x + o_proj(attn(rmsnorm(x))),
// out = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h))); final rmsnorm;
// lm_head; mean cross-entropy), float32 compute through OpenBLAS, kernels in
// layers.hpp, wired into layers in decoder.hpp (shared with LlamaStage, a
// pipeline stage of the model).
//
// Parameters live in one contiguous float32 buffer, gradients in another of
// the same layout, in Hugging Face's names and order, so data-parallel
// strategies can bucket and shard over them and checkpoints map one to one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshrun::llama {

// Hugging Face config.json names. head_dim = hidden_size / num_attention_heads.
struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 768;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 8;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
};

// One parameter tensor: its Hugging Face name and shape ([out, in] for linear
// weights), and its place in the parameter and gradient buffers.
struct ParameterView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;
  float* grad = nullptr;
  int64_t numel = 0;
};

// The unit a hook call is about: a decoder layer by its index, or the root,
// which owns embed_tokens, norm and lm_head and encloses the layers.
inline constexpr int kRootUnit = -1;

// Called by the model at module boundaries (DESIGN.md "Hooks"). Order of one
// forward and backward with L layers:
//   pre_forward(root)  [embedding]
//     pre_forward(0) post_forward(0) ... pre_forward(L-1) post_forward(L-1)
//   [norm, lm_head, loss]  post_forward(root)
//   pre_backward(root)  [loss, lm_head, norm]
//     pre_backward(L-1) post_backward(L-1) ... pre_backward(0) post_backward(0)
//   [embedding]  post_backward(root)
// gradient_ready(p) comes once the gradient of parameters()[p] is final for
// this backward, in reverse parameter order (lm_head and norm before the
// layers, embed_tokens last), so DDP can reduce buckets as they fill.
// post_backward(unit) follows the gradient_ready of all its parameters, so
// FSDP can reduce-scatter the unit; the root's comes last, since
// embed_tokens (tied or not) is final only after the embedding backward.
struct ModuleHooks {
  virtual ~ModuleHooks() = default;
  virtual void pre_forward(int /*unit*/) {}
  virtual void post_forward(int /*unit*/) {}
  virtual void pre_backward(int /*unit*/) {}
  virtual void post_backward(int /*unit*/) {}
  virtual void gradient_ready(int /*parameter*/) {}
};

class LlamaModel {
 public:
  // Weights as init_weights(0). Throws std::invalid_argument for sizes the
  // architecture cannot take. Sets OpenBLAS to one thread unless OPENBLAS_NUM_THREADS says
  // otherwise: the trainer runs one rank per core.
  explicit LlamaModel(LlamaConfig config);
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;
  LlamaModel(LlamaModel&&) noexcept;
  LlamaModel& operator=(LlamaModel&&) noexcept;

  const LlamaConfig& config() const { return config_; }
  // In buffer order: model.embed_tokens.weight; per layer N
  // model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
  // post_attention_layernorm, mlp.{gate,up,down}_proj}.weight;
  // model.norm.weight; lm_head.weight unless tied.
  std::vector<ParameterView>& parameters() { return parameters_; }
  const std::vector<ParameterView>& parameters() const { return parameters_; }
  float* param_buffer() { return params_.data(); }
  float* grad_buffer() { return grads_.data(); }
  // Elements over all parameters (also after release_storage).
  int64_t num_parameters() const { return num_parameters_; }

  // Matrices ~ normal(0, 0.02), norms = 1, from splitmix64 + Box-Muller so
  // that a seed gives the same weights with any standard library.
  void init_weights(uint64_t seed);

  // Mean natural-log cross-entropy over all batch * seq_len targets. tokens
  // and targets are [batch, seq_len]. Keeps what backward needs; buffers are
  // allocated once per (batch, seq_len) shape. Throws std::out_of_range for
  // a token or target outside the vocabulary.
  float forward(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len);
  // Accumulates (+=) into the gradients the gradient of the last forward's
  // loss. Consumes that forward: a second backward needs a new forward.
  void backward();
  void zero_grad();

  // Frees the parameter and gradient buffers and nulls every view's data
  // and grad: a sharded strategy owns the storage from now on, and the
  // caller points the views at it (in the hooks) before each use.
  // param_buffer() and grad_buffer() are null afterwards.
  void release_storage();

  // The hidden states entering decoder layer `layer` (layer L: leaving the
  // last one), [batch * seq_len, hidden_size], valid during a forward from
  // pre_forward(layer) on; the hooks may modify them in place (e.g. the
  // casts of a mixed-precision policy). Null before the first forward.
  float* hidden_states(int64_t layer);
  int64_t hidden_states_numel() const;

  // Hooks stay owned by the caller; nullptr removes them.
  void set_hooks(ModuleHooks* hooks);

 private:
  static constexpr int kEmbedIndex = 0;
  struct Activations;
  class HookedGradients;

  // The first of decoder layer `layer`'s views; the others follow it.
  const ParameterView* layer_views(int64_t layer) const;

  LlamaConfig config_;
  std::vector<float> params_;
  std::vector<float> grads_;
  int64_t num_parameters_ = 0;
  std::vector<ParameterView> parameters_;
  int norm_index_ = 0;
  int lm_head_index_ = kEmbedIndex;  // its own index unless tied
  std::unique_ptr<Activations> acts_;
  ModuleHooks* hooks_;
};

// Rounds every value to the nearest bfloat16 (ties to even), kept as float:
// bfloat16 parameter storage (torch_dtype = "bfloat16") with float32 compute,
// applied to param_buffer() after each optimizer step.
void round_to_bfloat16(float* values, int64_t count);

}  // namespace meshrun::llama
