// What a run reports: DIR/metrics.jsonl (one JSON object per step, docs/design.md
// "User-facing contract") and the progress line, both on rank 0 only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "state/durable_io.hpp"
#include "train/rank_gpu.hpp"

namespace meshrun::train {

// Bytes one rank holds, the "mem" object of a metrics line.
struct MemoryUse {
  int64_t params = 0;
  int64_t grads = 0;
  int64_t optimizer = 0;
  int64_t buffers = 0;           // the strategy's communication and gathered buffers
  int64_t buffers_peak = 0;      // the most `buffers` has been so far
  int64_t buffers_reserved = 0;  // `buffers` plus the strategy's cache for reuse
  // What the model held for backward after the step's last forward (a
  // pipeline: the most at once in the step, over the rank's stages), the
  // recompute scratch of activation checkpointing included.
  int64_t activations = 0;
  int64_t activations_peak = 0;  // the most `activations` has been so far
  int64_t peak_rss = 0;
  int64_t peak_rss_at_start = 0;  // peak_rss when the first step began
  // On a GPU (GpuMemoryPeaks, train/rank_gpu.hpp): the most of its memory
  // in use at the trainer's samples, after each forward and at each step's
  // end, and its stream-ordered pool's high-water mark; absent on the CPU.
  std::optional<int64_t> device_used_peak;
  std::optional<int64_t> device_allocated_peak;
  // A mixture of experts' share (its experts' own strategy): the experts'
  // shard and the most of them gathered at once; absent for a dense model.
  struct Experts {
    int64_t params = 0;
    int64_t buffers_peak = 0;
  };

  // The GPU's memory peaks into `use` (device_used_peak,
  // device_allocated_peak); nothing without a GPU (null).
  void report_device_memory(RankGpu* gpu, MemoryUse& use);
  std::optional<Experts> experts;
};

// mem.activations and mem.activations_peak from samples of what the model
// holds for backward, taken after forwards.
class ActivationMeter {
 public:
  void begin_step() { step_ = 0; }
  void sample(int64_t bytes);
  // Sets use.activations and use.activations_peak.
  void report(MemoryUse& use) const;

 private:
  int64_t step_ = 0, peak_ = 0;
};

// A mixture of experts' step: the routers' load-balancing loss (the mean
// over the global batch and the model's layers, before
// router_aux_loss_coef), the slots each expert took over all ranks and
// layers, and what this rank's dispatch and combine sent (all-to-alls over
// ep) and waited.
struct ExpertMetrics {
  double aux_loss = 0;
  std::vector<int64_t> expert_tokens;
  int64_t ep_bytes = 0;
  double ep_wait_s = 0;
};

struct StepMetrics {
  int64_t step = 0;  // 1-based: the number of optimizer steps done
  double loss = 0;   // mean over the global batch
  double tokens_per_s = 0;
  double step_time_s = 0;
  // The model's FLOPs per second in the step (train/throughput.hpp) and
  // their share of the ranks' GEMM peak in the run's matmul dtype.
  double flops_per_s = 0;
  double mfu = 0;
  double lr = 0;
  double grad_norm = 0;  // before clipping
  // The loss or the gradient norm was not finite: no update was applied
  // (train.skip_nonfinite_steps).
  bool skipped = false;
  // Time finish_gradients blocked: the gradient communication backward did
  // not hide.
  double grad_sync_wait_s = 0;
  // Time the step spent inside the strategy's calls (hooks and
  // finish_gradients): its communication that compute did not hide.
  double comm_wait_s = 0;
  // Bytes this rank's tensor-parallel collectives sent in the step (the
  // model's all-reduces over tp); 0 without tensor parallelism.
  int64_t tp_bytes = 0;
  // Bytes this rank's context-parallel transfers sent in the step (ring
  // attention's key/value blocks and their gradients, Ulysses' all-to-alls)
  // and the time the model blocked waiting for them; 0 without cp.
  int64_t cp_bytes = 0;
  double cp_wait_s = 0;
  std::optional<ExpertMetrics> moe;  // with experts only
  std::optional<double> val_loss;
  MemoryUse mem;
};

// This process's peak resident set size in bytes (getrusage's ru_maxrss).
int64_t peak_rss_bytes();

class MetricsLog {
 public:
  // Opens `path` for the steps after `first_step`. The lines of steps up to
  // `first_step` already in it are kept, so a run resumed into its own
  // output folder continues its log; every other line (a later step the
  // resumed run redoes, a line that is not JSON) is dropped.
  MetricsLog(const std::string& path, int64_t first_step);
  // Appends one line, straight to the file, so a crashed run keeps its
  // metrics; a line the disk does not take throws naming the file.
  void write(const StepMetrics& metrics);

 private:
  // The kept lines are read before the file is truncated for writing.
  MetricsLog(const std::string& path, const std::vector<std::string>& kept);

  OutputFile out_;
};

// The step's JSON object, one line of metrics.jsonl without its newline.
std::string metrics_line(const StepMetrics& metrics);

// "step 12/100 loss 3.2100 tok/s 5400 ETA 0:42" (+ " val_loss 3.1000").
std::string progress_line(const StepMetrics& metrics, int64_t steps, double eta_seconds);

}  // namespace meshrun::train
