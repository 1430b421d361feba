#include "train/metrics.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshrun::train {

int64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t(usage.ru_maxrss) * 1024;  // Linux reports kilobytes
}

namespace {

// The lines of `path` whose step is at most `last_step`; none when the file
// does not exist.
std::vector<std::string> lines_through(const std::string& path, int64_t last_step) {
  std::vector<std::string> kept;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("step") || !parsed["step"].is_number_integer()) {
      continue;
    }
    if (parsed["step"].get<int64_t>() <= last_step) kept.push_back(line);
  }
  return kept;
}

}  // namespace

void ActivationMeter::sample(int64_t bytes) {
  step_ = std::max(step_, bytes);
  peak_ = std::max(peak_, bytes);
}

void ActivationMeter::report(MemoryUse& use) const {
  use.activations = step_;
  use.activations_peak = peak_;
}

MetricsLog::MetricsLog(const std::string& path, int64_t first_step)
    : MetricsLog(path,
                 first_step > 0 ? lines_through(path, first_step) : std::vector<std::string>{}) {}

MetricsLog::MetricsLog(const std::string& path, const std::vector<std::string>& kept)
    : out_(path, path) {
  for (const std::string& line : kept) out_.write(line + "\n");
}

void MetricsLog::write(const StepMetrics& metrics) { out_.write(metrics_line(metrics) + "\n"); }

std::string metrics_line(const StepMetrics& m) {
  nlohmann::ordered_json line = {{"step", m.step},
                                 {"loss", m.loss},
                                 {"tokens_per_s", m.tokens_per_s},
                                 {"step_time_s", m.step_time_s},
                                 {"flops_per_s", m.flops_per_s},
                                 {"mfu", m.mfu},
                                 {"grad_sync_wait_s", m.grad_sync_wait_s},
                                 {"comm_wait_s", m.comm_wait_s},
                                 {"tp_bytes", m.tp_bytes},
                                 {"cp_bytes", m.cp_bytes},
                                 {"cp_wait_s", m.cp_wait_s},
                                 {"lr", m.lr},
                                 {"grad_norm", m.grad_norm}};
  if (m.moe) {
    line["aux_loss"] = m.moe->aux_loss;
    line["expert_tokens"] = m.moe->expert_tokens;
    line["ep_bytes"] = m.moe->ep_bytes;
    line["ep_wait_s"] = m.moe->ep_wait_s;
  }
  if (m.skipped) line["skipped"] = true;
  if (m.val_loss) line["val_loss"] = *m.val_loss;
  line["mem"] = {{"params", m.mem.params},
                 {"grads", m.mem.grads},
                 {"optimizer", m.mem.optimizer},
                 {"buffers", m.mem.buffers},
                 {"buffers_peak", m.mem.buffers_peak},
                 {"buffers_reserved", m.mem.buffers_reserved},
                 {"activations", m.mem.activations},
                 {"activations_peak", m.mem.activations_peak},
                 {"peak_rss", m.mem.peak_rss},
                 {"peak_rss_at_start", m.mem.peak_rss_at_start}};
  if (m.mem.device_used_peak) line["mem"]["device_used_peak"] = *m.mem.device_used_peak;
  if (m.mem.device_allocated_peak) {
    line["mem"]["device_allocated_peak"] = *m.mem.device_allocated_peak;
  }
  if (m.mem.experts) {
    line["mem"]["experts"] = {{"params", m.mem.experts->params},
                              {"buffers_peak", m.mem.experts->buffers_peak}};
  }
  return line.dump();
}

std::string progress_line(const StepMetrics& m, int64_t steps, double eta_seconds) {
  const auto eta = int64_t(eta_seconds + 0.5);
  std::string line = fmt::format("step {}/{} loss {:.4f} tok/s {:.0f} ETA {}:{:02d}", m.step, steps,
                                 m.loss, m.tokens_per_s, eta / 60, eta % 60);
  if (m.val_loss) line += fmt::format(" val_loss {:.4f}", *m.val_loss);
  return line;
}

void report_device_memory(RankGpu* gpu, MemoryUse& use) {
  if (gpu == nullptr) return;
  const GpuMemoryPeaks peaks = gpu->memory_peaks();
  use.device_used_peak = peaks.used;
  use.device_allocated_peak = peaks.allocated;
}

}  // namespace meshrun::train
