#include "train/loop.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "errors.hpp"
#include "state/durable_io.hpp"
#include "state/optimizer.hpp"
#include "trace/trace.hpp"
#include "train/throughput.hpp"

namespace meshrun::train {
namespace {

// The rank's memory now, with the peak RSS it had when training started.
MemoryUse memory_now(TrainingRank& rank, int64_t start_rss) {
  MemoryUse use = rank.memory_use();
  use.peak_rss_at_start = start_rss;
  return use;
}

using Clock = std::chrono::steady_clock;

bool due(const TrainConfig& train, int64_t every, int64_t step) {
  return step == train.steps || (every > 0 && step % every == 0);
}

// Runs `work` of training step `step` (1-based); its errors say the step.
template <class Work>
void in_step(int64_t step, Work&& work) {
  try {
    work();
  } catch (const Error& error) {
    throw Error(error.code(), fmt::format("step {}: {}", step, error.what()), error.key());
  }
}

// Collective over `world`: "; the gradient of 'NAME' is not finite (rank
// R)" for the first parameter of the model whose gradient is not finite on
// some rank, the lowest such rank; "" when no rank holds one (only the loss
// is not finite).
std::string first_nonfinite_gradient(TrainingRank& rank, const ModelDescription& description,
                                     Communicator& world) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  const std::optional<int64_t> local = rank.first_nonfinite_gradient();
  // The largest -(index * ranks + rank) is the lowest index, then rank.
  int64_t key = local ? -(*local * world.size() + world.rank()) : kNone;
  FlatTensor tensor(&key, dtype_int64(), 1);
  world.all_reduce(tensor.get(), ReduceOp::max).wait();
  if (key == kNone) return {};
  return fmt::format("; the gradient of '{}' is not finite (rank {})",
                     description.parameters[size_t(-key / world.size())].name, -key % world.size());
}

// Steps in a row whose loss or gradient norm is not finite: skipped while
// train.skip_nonfinite_steps allows, then the run stops.
class NonFiniteSteps {
 public:
  NonFiniteSteps(const TrainConfig& train, const ModelDescription& description, bool writer)
      : allowed_(train.skip_nonfinite_steps), description_(description), writer_(writer) {}

  // After a step's gradient norm: whether its update may be applied.
  bool finite(const StepMetrics& metrics) {
    const bool finite = std::isfinite(metrics.loss) && std::isfinite(metrics.grad_norm);
    if (finite) in_a_row_ = 0;
    return finite;
  }

  // Collective: reports the non-finite step `metrics` (logged by `log`
  // first when the run stops) and throws NonFiniteStep once more than
  // allowed came in a row.
  void skip(const StepMetrics& metrics, TrainingRank& rank, int64_t start_rss, Communicator& world,
            std::optional<MetricsLog>& log) {
    const std::string what = fmt::format("step {}: the loss is {} and the gradient norm is {}{}",
                                         metrics.step, metrics.loss, metrics.grad_norm,
                                         first_nonfinite_gradient(rank, description_, world));
    if (++in_a_row_ > allowed_) {
      if (log) {
        StepMetrics logged = metrics;
        logged.mem = memory_now(rank, start_rss);
        log->write(logged);
      }
      throw NonFiniteStep(
          allowed_ == 0
              ? what +
                    "; the run stops: lower train.lr, or let train.skip_nonfinite_steps skip "
                    "such steps"
              : fmt::format("{}; the run stops after {} such steps in a row "
                            "(train.skip_nonfinite_steps = {})",
                            what, in_a_row_, allowed_));
    }
    if (writer_) {
      std::fprintf(stderr, "meshrun: warning: %s; the update is skipped (%lld of %lld in a row)\n",
                   what.c_str(), static_cast<long long>(in_a_row_),
                   static_cast<long long>(allowed_));
    }
  }

 private:
  int64_t allowed_;
  const ModelDescription& description_;
  bool writer_;
  int64_t in_a_row_ = 0;
};

// Collective over `world`: whether any rank's observer asked to stop.
bool stops(bool go_on, Communicator& world) {
  int64_t stop = go_on ? 0 : 1;
  FlatTensor tensor(&stop, dtype_int64(), 1);
  world.all_reduce(tensor.get(), ReduceOp::max).wait();
  return stop != 0;
}

// OUTPUT/trace.json from rank 0's gathered trace (null on other ranks).
void write_trace(const nlohmann::json& gathered, const std::string& output_dir) {
  if (gathered.is_null()) return;
  write_text_file((std::filesystem::path(output_dir) / "trace.json").string(),
                  gathered.dump() + "\n");
}

}  // namespace

void run_training(const Config& config, const ModelDescription& description,
                  int64_t tokens_per_step, Communicator& world, const std::string& output_dir,
                  const GemmPeakMeter& gemm_peak, int64_t first_step, TrainingRank& rank,
                  const StepObserver& observer) {
  const TrainConfig& train = config.train;
  const bool writer = world.rank() == 0;
  std::optional<MetricsLog> log;
  // Made once the rank's setup has succeeded, so that a run that fails
  // before its first step (a checkpoint that cannot be read, a GPU out of
  // memory) leaves no folder behind.
  if (writer) {
    std::filesystem::create_directories(output_dir);
    log.emplace((std::filesystem::path(output_dir) / "metrics.jsonl").string(), first_step);
  }
  NonFiniteSteps nonfinite(train, description, writer);
  const Throughput throughput =
      measure_throughput(config, description, tokens_per_step, world, output_dir, gemm_peak);
  trace::Trace& trace = trace::Trace::process();
  if (train.profile) trace.start(world);
  // What starting took: the weights in place, before the first step.
  const int64_t start_rss = peak_rss_bytes();
  double train_seconds = 0.0;
  for (int64_t step = first_step; step < train.steps; ++step) {
    const auto start = Clock::now();
    StepMetrics metrics;
    metrics.step = step + 1;
    in_step(metrics.step, [&] {
      rank.train_step(step, metrics);
      {
        const trace::TraceSpan optimizer("optimizer", trace::kComputeSpan);
        metrics.grad_norm = rank.gradient_norm();
        metrics.lr = learning_rate(train, step);
        metrics.skipped = !nonfinite.finite(metrics);
        if (!metrics.skipped) rank.optimizer_step(metrics);
      }
      const auto end = Clock::now();
      trace.span(fmt::format("step {}", metrics.step), trace::kStepSpan, start, end);
      metrics.step_time_s = std::chrono::duration<double>(end - start).count();
      metrics.tokens_per_s = double(tokens_per_step) / metrics.step_time_s;
      metrics.flops_per_s = throughput.flops_per_step / metrics.step_time_s;
      metrics.mfu = metrics.flops_per_s / throughput.peak_flops_per_s;
      if (metrics.skipped) nonfinite.skip(metrics, rank, start_rss, world, log);
      if (due(train, train.val_every, metrics.step)) {
        const trace::TraceSpan validation("validation", trace::kComputeSpan);
        metrics.val_loss = rank.validate();
      }
      metrics.mem = memory_now(rank, start_rss);
      const int64_t save_every = config.checkpoint.save_every;
      if (save_every > 0 && metrics.step % save_every == 0) rank.save_checkpoint(metrics.step);
    });
    train_seconds += metrics.step_time_s;
    if (writer) {
      log->write(metrics);
      if (due(train, train.log_every, metrics.step) || metrics.val_loss) {
        const double eta =
            train_seconds / double(metrics.step - first_step) * double(train.steps - metrics.step);
        std::printf("%s\n", progress_line(metrics, train.steps, eta).c_str());
        std::fflush(stdout);
      }
    }
    if (observer && stops(observer(metrics_line(metrics)), world)) break;
  }
  if (train.profile) write_trace(trace.gather(world), output_dir);
  rank.export_weights();
}

}  // namespace meshrun::train
