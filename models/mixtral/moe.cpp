#include "mixtral/moe.hpp"

#include <stdexcept>

#include "common/layers.hpp"
#include "common/support.hpp"

namespace meshrun::mixtral {

using namespace kernels;

namespace {

// norm2 = rmsnorm(h), out of line: selective checkpointing computes it
// again in the backward, and one copy of the code gives the same bits.
[[gnu::noinline]] void moe_input_norm(MoeActivations& saved, const ParameterView* layer,
                                      const MoePass& pass) {
  rmsnorm_forward(saved.norm2.data(), saved.rstd2.data(), saved.h.data(), layer[kPostNorm].data,
                  pass.rows(), pass.hidden, pass.eps);
}

models::MixtureShape mixture_shape(const MixtralConfig& c, int64_t rows) {
  return {rows,
          c.hidden_size,
          c.intermediate_size,
          c.num_local_experts,
          c.num_experts_per_tok,
          c.num_hidden_layers,
          c.router_aux_loss_coef};
}

}  // namespace

MoePass::MoePass(const MixtralConfig& c, int64_t batch, int64_t seq_len,
                 models::TensorParallelGroup& tp, bool sequence_parallel,
                 const models::ParallelBlocks& blocks, const models::ContextParallel& cp,
                 const models::ExpertParallel& ep)
    : DecoderPass(c, batch, seq_len, tp, sequence_parallel, blocks, cp),
      experts(mixture_shape(c, rows()), ep, Mixtral::kName),
      moe_out(size_t(rows() * hidden)) {}

MoeActivations::MoeActivations(const MoePass& pass)
    : AttentionActivations(pass),
      norm2(size_t(pass.rows() * pass.hidden)),
      rstd2(size_t(pass.rows())),
      experts(pass.experts) {}

int64_t MoeActivations::bytes() const {
  return AttentionActivations::bytes() + models::bytes_of(norm2, rstd2) + experts.bytes();
}

// The layer's views end with its experts' (this rank's only under ep).
void Mixtral::check_layer_storage(std::span<const ParameterView> layer, bool backward) {
  llama::check_attention_storage(layer.data(), backward);
  models::check_mixture_storage(layer.subspan(kRouter), backward, kName);
}

void Mixtral::check_tensor_parallel(const Config& /*config*/, int64_t tp,
                                    const models::ParallelBlocks& /*blocks*/) {
  models::require(tp == 1, kName,
                  "tensor parallelism: the Mixtral model computes its layers whole on each rank "
                  "(distributed.tp_size must be 1; spread the experts with ep_size)");
}

void Mixtral::layer_forward(Pass& pass, const ParameterView* layer, const float* x,
                            LayerActivations& saved, float* out) {
  llama::attention_forward(pass, layer, x, saved);
  moe_input_norm(saved, layer, pass);
  models::mixture_forward(pass.experts, &layer[kRouter], saved.norm2.data(), saved.experts,
                          pass.moe_out.data());
  residual_forward(out, saved.h.data(), pass.moe_out.data(), pass.rows() * pass.hidden);
}

void Mixtral::layer_backward(Pass& pass, const ParameterView* layer, const float* x,
                             LayerActivations& saved, WeightGradients& gradients) {
  models::mixture_backward(pass.experts, &layer[kRouter], pass.d_residual.data(), pass.loss_scale,
                           saved.experts, saved.norm2, pass.d_norm.data(), gradients);
  rmsnorm_backward(pass.d_residual.data(), layer[kPostNorm].grad, pass.d_norm.data(),
                   saved.h.data(), layer[kPostNorm].data, saved.rstd2.data(), pass.rows(),
                   pass.hidden);
  gradients.vector_ready(layer[kPostNorm]);
  llama::attention_backward(pass, layer, x, saved, gradients);
}

void Mixtral::recompute_elementwise(Pass& pass, const ParameterView* layer, const float* x,
                                    LayerActivations& saved) {
  llama::attention_norm(pass, layer, x, saved);
  moe_input_norm(saved, layer, pass);
}

}  // namespace meshrun::mixtral
