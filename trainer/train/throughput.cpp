#include "train/throughput.hpp"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "plan/plan.hpp"
#include "state/durable_io.hpp"

namespace meshrun::train {

Throughput measure_throughput(const Config& config, const ModelDescription& description,
                              int64_t tokens_per_step, Communicator& world,
                              const std::string& output_dir, const GemmPeakMeter& gemm_peak,
                              double seconds) {
  Throughput throughput;
  throughput.matmul_dtype = matmul_dtype(config, description);
  throughput.flops_per_token = flops_per_token(description, config.data.seq_len);
  throughput.flops_per_step = throughput.flops_per_token * double(tokens_per_step);
  const GemmPeak peak = gemm_peak(throughput.matmul_dtype, seconds);
  auto rate = int64_t(peak.flops_per_s);
  FlatTensor tensor(&rate, dtype_int64(), 1);
  world.all_reduce(tensor.get(), ReduceOp::sum).wait();
  throughput.peak_flops_per_s = double(rate);
  throughput.peak_source = peak.source;
  if (world.rank() == 0) {
    const nlohmann::ordered_json record = {{"ranks", world.size()},
                                           {"matmul_dtype", throughput.matmul_dtype},
                                           {"flops_per_token", throughput.flops_per_token},
                                           {"flops_per_step", throughput.flops_per_step},
                                           {"peak_flops_per_s", throughput.peak_flops_per_s},
                                           {"peak_source", throughput.peak_source}};
    write_text_file((std::filesystem::path(output_dir) / "run.json").string(),
                    record.dump(2) + "\n");
  }
  return throughput;
}

}  // namespace meshrun::train
