#include "train/loop.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>

namespace meshrun::train {
namespace {

using Clock = std::chrono::steady_clock;

bool due(const TrainConfig& train, int64_t every, int64_t step) {
  return step == train.steps || (every > 0 && step % every == 0);
}

}  // namespace

void run_training(const Config& config, int64_t tokens_per_step, Communicator& world,
                  const std::string& output_dir, int64_t first_step, TrainingRank& rank) {
  const TrainConfig& train = config.train;
  const bool writer = world.rank() == 0;
  std::optional<MetricsLog> log;
  if (writer) {
    log.emplace((std::filesystem::path(output_dir) / "metrics.jsonl").string(), first_step);
  }
  double train_seconds = 0.0;
  for (int64_t step = first_step; step < train.steps; ++step) {
    const auto start = Clock::now();
    StepMetrics metrics;
    metrics.step = step + 1;
    rank.train_step(step, metrics);
    rank.optimizer_step(step, metrics);
    metrics.step_time_s = std::chrono::duration<double>(Clock::now() - start).count();
    metrics.tokens_per_s = double(tokens_per_step) / metrics.step_time_s;
    train_seconds += metrics.step_time_s;
    if (due(train, train.val_every, metrics.step)) metrics.val_loss = rank.validate();
    metrics.mem = rank.memory_use();
    const int64_t save_every = config.checkpoint.save_every;
    if (save_every > 0 && metrics.step % save_every == 0) rank.save_checkpoint(metrics.step);
    if (!writer) continue;
    log->write(metrics);
    if (due(train, train.log_every, metrics.step) || metrics.val_loss) {
      const double eta =
          train_seconds / double(metrics.step - first_step) * double(train.steps - metrics.step);
      std::printf("%s\n", progress_line(metrics, train.steps, eta).c_str());
      std::fflush(stdout);
    }
  }
  rank.export_weights();
}

}  // namespace meshrun::train
