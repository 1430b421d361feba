// The training loop every kind of rank shares: steps, validation, metrics,
// checkpoints and the final export, over what one rank does for each
// (data-parallel Trainer, pipeline PipelineTrainer).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/model.hpp"
#include "train/metrics.hpp"
#include "train/throughput.hpp"

namespace meshrun::train {

class TrainingRank {
 public:
  virtual ~TrainingRank() = default;
  // Forward and backward of one step's global batch; sets metrics.loss
  // (mean over the global batch) and the communication waits.
  virtual void train_step(int64_t step, StepMetrics& metrics) = 0;
  // Collective: the norm of the step's whole gradient before clipping, the
  // same on every rank.
  virtual double gradient_norm() = 0;
  // Clipping to metrics.grad_norm and the update with metrics.lr.
  virtual void optimizer_step(const StepMetrics& metrics) = 0;
  // The description index of the first parameter whose gradient is not
  // finite in this rank's part of it; no communication.
  virtual std::optional<int64_t> first_nonfinite_gradient() = 0;
  // docs/design.md's val_loss; nullopt without validation windows.
  virtual std::optional<double> validate() = 0;
  virtual MemoryUse memory_use() = 0;
  // Collective: the sharded checkpoint of `step` under DIR/checkpoints.
  virtual void save_checkpoint(int64_t step) = 0;
  // Collective: the consolidated weights into the output folder (rank 0).
  virtual void export_weights() = 0;
};

// Thrown alike on every rank when a step's loss or gradient norm is not
// finite and train.skip_nonfinite_steps does not let it be skipped: the
// message names the step and the first parameter whose gradient is not
// finite.
class NonFiniteStep : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a host running the trainer in its own process hears after each step
// (the host API's meshrun_run_train): the step's metrics line, on every
// rank (its own mem). Returns false to stop the run after this step; the
// ranks agree (one stopping stops all) before the next step starts.
using StepObserver = std::function<bool(const std::string& metrics_line)>;

// Trains steps [first_step, train.steps) of `rank` of a model described by
// `description`; rank 0 of `world` makes OUTPUT and writes OUTPUT/metrics.jsonl and the
// progress lines; mfu divides by what `gemm_peak` measures. Every rank
// decides alike whether a step is non-finite: the loss and the gradient
// norm are reduced over the ranks. A run stopped by `observer` ends as the
// last step would: the trace, then the export.
void run_training(const Config& config, const ModelDescription& description,
                  int64_t tokens_per_step, Communicator& world, const std::string& output_dir,
                  const GemmPeakMeter& gemm_peak, int64_t first_step, TrainingRank& rank,
                  const StepObserver& observer = {});

}  // namespace meshrun::train
