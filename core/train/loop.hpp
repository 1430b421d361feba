// The training loop every kind of rank shares: steps, validation, metrics,
// checkpoints and the final export, over what one rank does for each
// (data-parallel Trainer, pipeline PipelineTrainer).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "train/metrics.hpp"

namespace meshrun::train {

class TrainingRank {
 public:
  virtual ~TrainingRank() = default;
  // Forward and backward of one step's global batch; sets metrics.loss
  // (mean over the global batch) and the communication waits.
  virtual void train_step(int64_t step, StepMetrics& metrics) = 0;
  // Clipping and the optimizer update; sets metrics.grad_norm and lr.
  virtual void optimizer_step(int64_t step, StepMetrics& metrics) = 0;
  // docs/design.md's val_loss; nullopt without validation windows.
  virtual std::optional<double> validate() = 0;
  virtual MemoryUse memory_use() = 0;
  // Collective: the sharded checkpoint of `step` under DIR/checkpoints.
  virtual void save_checkpoint(int64_t step) = 0;
  // Collective: the consolidated weights into the output folder (rank 0).
  virtual void export_weights() = 0;
};

// Trains steps [first_step, train.steps) of `rank`; rank 0 of `world`
// writes OUTPUT/metrics.jsonl and the progress lines.
void run_training(const Config& config, int64_t tokens_per_step, Communicator& world,
                  const std::string& output_dir, int64_t first_step, TrainingRank& rank);

}  // namespace meshrun::train
