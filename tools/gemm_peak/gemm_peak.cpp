#include "gemm_peak/gemm_peak.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>

#include "errors.hpp"
#include "gemm_peak/cuda_peak.hpp"
#include "launch/launch.hpp"
#include "mesh/device.hpp"
#include "numeric/peak.hpp"

namespace meshrun::train {
namespace {

constexpr const char* kStatedPeakVariable = "MESHRUN_GEMM_PEAK_FLOPS";

// MESHRUN_GEMM_PEAK_FLOPS="float32=1.2e11,bfloat16=2.4e11": one rank's GEMM
// peak in FLOP/s per matmul dtype, stated instead of measured at the start
// of the run (0.1 s per run): a datasheet figure, or `meshrun bench peak`'s
// on a quiet machine, so that MFU compares across runs on a busy one. A
// dtype it does not name, or an empty variable, is measured. Throws INVALID_ARGUMENT naming the
// variable and the entry.
std::map<std::string, double> stated_gemm_peaks() {
  std::map<std::string, double> peaks;
  const char* value = std::getenv(kStatedPeakVariable);
  if (value == nullptr || *value == '\0') return peaks;
  const std::string text = value;
  size_t start = 0;
  for (int position = 1; start <= text.size(); ++position) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string entry = text.substr(start, comma - start);
    start = comma + 1;
    const size_t equals = entry.find('=');
    const std::string dtype = entry.substr(0, equals);
    char* end = nullptr;
    const double flops =
        equals == std::string::npos ? 0 : std::strtod(entry.c_str() + equals + 1, &end);
    const bool number = end != nullptr && end != entry.c_str() + equals + 1 && *end == '\0';
    if ((dtype != "float32" && dtype != "bfloat16") || !number || !std::isfinite(flops) ||
        flops <= 0 || peaks.contains(dtype)) {
      throw invalid_argument(fmt::format(
          "{}: entry {} \"{}\": expected DTYPE=FLOPS with DTYPE float32 or bfloat16 (each at "
          "most once) and FLOPS a positive number, one rank's GEMM peak, e.g. "
          "\"float32=1.2e11,bfloat16=2.4e11\"",
          kStatedPeakVariable, position, entry));
    }
    peaks[dtype] = flops;
  }
  return peaks;
}

}  // namespace

GemmPeakMeter gemm_peak_meter(bool on_cuda) {
  return [stated = stated_gemm_peaks(), on_cuda](const std::string& dtype, double seconds) {
    const auto found = stated.find(dtype);
    if (found != stated.end()) return GemmPeak{found->second, kStatedPeakVariable};
    if (!on_cuda) return GemmPeak{gemm_flops_per_s(dtype, seconds), "measured"};
    const auto launched = launch::detect_launcher();
    const int32_t device = launched_rank_gpu(launched ? launched->rank : 0);
    constexpr int64_t kSize = 8192;  // `meshrun bench peak --device cuda`'s
    const CudaPeak peak = measure_cuda_peak(device, kSize, std::max(seconds, 0.25));
    return GemmPeak{peak.gemm_flops_per_s,
                    fmt::format("measured on cuda:{} ({}), bfloat16", device, peak.device_name)};
  };
}

}  // namespace meshrun::train
