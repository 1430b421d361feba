// What the pipeline executor runs for one stage this rank holds: the
// stage's compute for one microbatch, in the executor's buffers, and the
// sharded data-parallel work the schedule asks of the stage. The model
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
  // which computes the loss). The gradients that travel back have the same
  // sizes.
  virtual int64_t input_numel() const = 0;
  virtual int64_t output_numel() const = 0;

  // F: the forward of microbatch `microbatch`; `input` is the previous
  // stage's output (null on the first stage); writes `output` (null on the
  // last stage). Keeps what its backward needs until then: the executor
  // frees `input` as soon as F returns.
  virtual void forward(int32_t microbatch, const float* input, float* output) = 0;
  // B: the full backward; `grad_output` is the next stage's grad_input (null
  // on the last stage, which starts from its loss); writes `grad_input`
  // (null on the first stage); accumulates the weight gradients.
  //
  // The last stage owns the loss, so it owns its scale too: it seeds the
  // backward with the loss gradient already scaled as the training asks
  // (PipelineConfig's scale_grads_in_schedule: 1/microbatches when true, the
  // trainer's own normalization otherwise). Every other stage only
  // propagates what it receives, and the executor moves gradients unchanged.
  virtual void backward(int32_t microbatch, const float* grad_output, float* grad_input) = 0;
  // I: the backward to the input only; keeps what W needs. Same buffers and
  // loss scaling as B.
  virtual void backward_input(int32_t microbatch, const float* grad_output, float* grad_input) = 0;
  // W: the weight gradients of a microbatch whose I has run.
  virtual void backward_weight(int32_t microbatch) = 0;
};

// A sharded data-parallel strategy's work for one stage (FSDP2 units of the
// stage), done when the schedule's UNSHARD, RESHARD and REDUCE_GRAD actions
// say. A stage without one (DDP, or no data parallelism) treats those
// actions as nothing to do. The calls may start asynchronous work and
// return; the stage's next compute waits for what it needs.
class StageSharding {
 public:
  virtual ~StageSharding() = default;

  // Gathers the stage's full parameters before its first compute.
  virtual void unshard() = 0;
  // Frees the gathered parameters once the stage computes no more.
  virtual void reshard() = 0;
  // Reduces the stage's accumulated gradients over the data-parallel axis.
  virtual void reduce_grad() = 0;
};

}  // namespace meshrun::pipeline
