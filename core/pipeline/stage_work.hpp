// What the pipeline executor runs for one stage this rank holds: the
// stage's compute for one microbatch, in the executor's buffers. The model
// side (e.g. a Llama stage) adapts to this; the executor knows nothing of
// models, and a synthetic stage of fixed cost serves the benchmarks.
#pragma once

#include <cstdint>

namespace meshrun::pipeline {

class StageWork {
 public:
  virtual ~StageWork() = default;

  // Elements of one microbatch's activation entering this stage (0 for the
  // first stage, which reads tokens) and leaving it (0 for the last stage,
  // which computes the loss).
  virtual int64_t input_numel() const = 0;
  virtual int64_t output_numel() const = 0;

  // F: the forward of microbatch `microbatch`; `input` is the previous
  // stage's output (null on the first stage); writes `output` (null on the
  // last stage). Keeps what its backward needs until then.
  virtual void forward(int32_t microbatch, const float* input, float* output) = 0;
  // B: the full backward; `grad_output` is the next stage's grad_input (null
  // on the last stage, which starts from its loss); writes `grad_input`
  // (null on the first stage); accumulates the weight gradients.
  virtual void backward(int32_t microbatch, const float* grad_output, float* grad_input) = 0;
  // I: the backward to the input only; keeps what W needs.
  virtual void backward_input(int32_t microbatch, const float* grad_output,
                              float* grad_input) = 0;
  // W: the weight gradients of a microbatch whose I has run.
  virtual void backward_weight(int32_t microbatch) = 0;
};

}  // namespace meshrun::pipeline
