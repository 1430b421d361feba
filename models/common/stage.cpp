#include "common/stage.hpp"

#include <stdexcept>

#include "common/layers.hpp"

namespace meshrun::models {

void accumulate_weight_gradient(const LinearWeight& weight, const float* dy, const float* x) {
  weight.compute->linear_backward_weight(weight.layout, weight.first->grad, dy, x, weight.rows,
                                         weight.in, weight.out);
}

void ImmediateWeightGradients::linear(const LinearWeight& weight, const float* dy,
                                      Buffer<float>& x) {
  accumulate_weight_gradient(weight, dy, x.data());
  for (const ParameterView* view = weight.last; view >= weight.first; --view) ready(*view);
}

double lm_head_loss_forward(float* logits, const float* x, const ParameterView& lm_head,
                            const int32_t* targets, int64_t rows, int64_t hidden,
                            const VocabShard& vocab, TensorParallelGroup& tp, Compute& compute) {
  compute.linear_forward(WeightLayout::out_in, logits, x, weight_of(lm_head), rows, hidden,
                         vocab.size);
  return vocab_parallel_cross_entropy_forward(logits, targets, rows, vocab, tp, compute);
}

void lm_head_loss_backward(float* dx, float* logits, const ParameterView& lm_head, Buffer<float>& x,
                           const int32_t* targets, float loss_scale, int64_t rows, int64_t hidden,
                           const VocabShard& vocab, WeightGradients& gradients, Compute& compute) {
  vocab_parallel_cross_entropy_backward(logits, targets, rows, vocab, loss_scale, compute);
  compute.linear_backward_input(WeightLayout::out_in, dx, logits, weight_of(lm_head), rows, hidden,
                                vocab.size);
  gradients.linear({&lm_head, &lm_head, WeightLayout::out_in, rows, hidden, vocab.size, &compute},
                   logits, x);
}

void require(bool condition, const char* family, const std::string& message) {
  if (!condition) throw std::invalid_argument(std::string(family) + ": " + message);
}

}  // namespace meshrun::models
