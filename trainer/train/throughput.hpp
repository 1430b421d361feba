// What a training step's speed is measured against (docs/design.md, "MFU"):
// the model's FLOPs per token and the machine's GEMM peak in the dtype the
// run's matmuls compute in. Recorded once per run in DIR/run.json; each
// metrics.jsonl line carries flops_per_s and mfu.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/model.hpp"

namespace meshrun::train {

// One rank's GEMM peak and where it came from: "measured", or the name of
// what stated it (meshrun's CLI: the MESHRUN_GEMM_PEAK_FLOPS variable).
struct GemmPeak {
  double flops_per_s = 0;
  std::string source;
};

// The GEMM rate (FLOP/s) the calling thread sustains in `matmul_dtype`
// ("float32" or "bfloat16") over about `seconds`, or a rate the user stated.
// The program that trains supplies it (meshrun's CLI measures through
// oneDNN, the library the shipped models compute with:
// plugins/numeric/peak.hpp), so that the core depends on no compute library
// and a device's own peak can take its place.
using GemmPeakMeter = std::function<GemmPeak(const std::string& matmul_dtype, double seconds)>;

struct Throughput {
  std::string matmul_dtype;  // "float32" or "bfloat16"
  double flops_per_token = 0;
  double flops_per_step = 0;    // flops_per_token x the tokens of a step
  double peak_flops_per_s = 0;  // the GEMM peak of all ranks together
  std::string peak_source;      // rank 0's GemmPeak::source
};

// Collective over `world`: every rank measures with `gemm_peak` the GEMM
// rate its core sustains in the run's matmul dtype for about `seconds` (at
// once, so ranks sharing a core measure their share), and the rates are
// summed (a stated rate is summed the same way). Rank 0 writes
// OUTPUT/run.json.
Throughput measure_throughput(const Config& config, const ModelDescription& description,
                              int64_t tokens_per_step, Communicator& world,
                              const std::string& output_dir, const GemmPeakMeter& gemm_peak,
                              double seconds = 0.1);

}  // namespace meshrun::train
