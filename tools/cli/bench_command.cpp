// meshrun bench comm [--nproc N] [--ops ...] [--sizes ...] [--dtype D] [--backend B] [--json]
// meshrun bench memcpy [--sizes ...] [--json]
// meshrun bench peak [--device cpu|cuda[:N]] [--threads N] [--dtype float32,bfloat16]
//                    [--seconds S] [--json]
#include <fmt/format.h>

#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "bench/comm_bench.hpp"
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "errors.hpp"
#include "gemm_peak/cuda_peak.hpp"
#include "launch/launch.hpp"
#include "numeric/peak.hpp"

namespace meshrun::cli {
namespace {

constexpr const char* kBenchUsage =
    "usage: meshrun bench comm [--nproc N]\n"
    "                          [--ops all_reduce,all_gather,reduce_scatter,sendrecv,all_to_all]\n"
    "                          [--sizes 64K,1M,16M,64M,256M] [--dtype float32|bfloat16|float16]\n"
    "                          [--backend mpi] [--seconds S] [--timeout-minutes M] [--json]\n"
    "       meshrun bench memcpy [--sizes 1M,16M,64M,256M] [--seconds S] [--json]\n"
    "       meshrun bench peak [--device cpu|cuda[:N]] [--threads N] [--dtype float32,bfloat16]\n"
    "                          [--seconds S] [--json]";

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

std::vector<int64_t> parse_sizes(const ParsedArgs& parsed, const std::string& fallback) {
  std::vector<int64_t> sizes;
  for (const auto& item : split_list(parsed.value("sizes").value_or(fallback))) {
    sizes.push_back(parse_byte_size(item));
  }
  if (sizes.empty()) throw invalid_argument("--sizes: give at least one size, e.g. 1M,16M");
  return sizes;
}

double parse_seconds(const ParsedArgs& parsed, const char* option, double fallback) {
  const auto text = parsed.value(option);
  if (!text) return fallback;
  char* end = nullptr;
  const double value = std::strtod(text->c_str(), &end);
  if (end != text->c_str() + text->size() || !(value > 0) || value > 1e6) {
    throw invalid_argument(
        fmt::format("--{}: expected a positive number, got '{}'", option, *text));
  }
  return value;
}

CommBenchOptions comm_options(const ParsedArgs& parsed) {
  CommBenchOptions options;
  for (const auto& name : split_list(parsed.value("ops").value_or("all_reduce,all_gather,"
                                                                  "reduce_scatter,sendrecv"))) {
    options.ops.push_back(bench_op_from_name(name));
  }
  if (options.ops.empty()) throw invalid_argument("--ops: give at least one operation");
  options.sizes = parse_sizes(parsed, "64K,1M,16M,64M,256M");
  const std::string dtype = parsed.value("dtype").value_or("float32");
  if (dtype != "float32" && dtype != "bfloat16" && dtype != "float16") {
    throw invalid_argument(
        fmt::format("--dtype: '{}' is not benchmarked; valid: float32, bfloat16, float16", dtype));
  }
  options.dtype = dtype_from_name(dtype);
  options.seconds_per_size = parse_seconds(parsed, "seconds", 0.3);
  return options;
}

nlohmann::ordered_json result_json(const CommBenchResult& r) {
  return {{"op", r.op},
          {"dtype", r.dtype},
          {"nproc", r.nproc},
          {"bytes", r.bytes},
          {"time_us", r.time_us},
          {"algbw_gbps", r.algbw_gbps},
          {"busbw_gbps", r.busbw_gbps},
          {"correct", r.correct}};
}

void print_comm_results(const std::vector<CommBenchResult>& results, bool json) {
  if (!json) {
    std::printf("%-15s %-9s %5s %12s %12s %10s %10s %8s\n", "op", "dtype", "ranks", "bytes",
                "time_us", "algbw_GB/s", "busbw_GB/s", "correct");
  }
  for (const auto& r : results) {
    if (json) {
      std::puts(result_json(r).dump().c_str());
    } else {
      std::printf("%-15s %-9s %5lld %12lld %12.1f %10.3f %10.3f %8s\n", r.op.c_str(),
                  r.dtype.c_str(), static_cast<long long>(r.nproc), static_cast<long long>(r.bytes),
                  r.time_us, r.algbw_gbps, r.busbw_gbps, r.correct ? "yes" : "NO");
    }
  }
  std::fflush(stdout);
}

int run_comm(const Args& args, const ParsedArgs& parsed) {
  const int nproc =
      static_cast<int>(parse_int_option("nproc", parsed.value("nproc").value_or("2"), 1, 4096));
  const CommBenchOptions options = comm_options(parsed);
  const double timeout = parse_seconds(parsed, "timeout-minutes", 10.0) * 60.0;
  if (auto status = relaunch_if_needed(nproc, "bench", args)) return *status;
  CommBackend backend(PluginLoader::from_environment(), parsed.value("backend").value_or("mpi"));
  Communicator world = backend.world(timeout);
  std::vector<CommBenchResult> results;
  try {
    results = run_comm_bench(world, options);
  } catch (const Error& error) {
    launch::abort_rank(world.rank(), error.what());
  }
  bool all_correct = true;
  for (const auto& r : results) all_correct = all_correct && r.correct;
  if (world.rank() == 0) print_comm_results(results, parsed.has_flag("json"));
  return all_correct ? 0 : 1;
}

int run_memcpy(const ParsedArgs& parsed) {
  const auto results = run_memcpy_bench(parse_sizes(parsed, "1M,16M,64M,256M"),
                                        parse_seconds(parsed, "seconds", 0.3));
  for (const auto& r : results) {
    if (parsed.has_flag("json")) {
      nlohmann::ordered_json json = {
          {"op", "memcpy"}, {"bytes", r.bytes}, {"time_us", r.time_us}, {"gbps", r.gbps}};
      std::puts(json.dump().c_str());
    } else {
      std::printf("memcpy %12lld bytes %10.1f us %8.3f GB/s\n", static_cast<long long>(r.bytes),
                  r.time_us, r.gbps);
    }
  }
  return 0;
}

// The GEMM peak MFU is measured against: one thread per core by default,
// as training runs one rank per core.
// The CUDA device of --device cuda or cuda:N; nullopt for cpu (the default).
std::optional<int32_t> cuda_device(const ParsedArgs& parsed) {
  const std::string device = parsed.value("device").value_or("cpu");
  if (device == "cpu") return std::nullopt;
  if (device == "cuda") return 0;
  if (device.starts_with("cuda:")) {
    return int32_t(parse_int_option("device", device.substr(5), 0, 1023));
  }
  throw invalid_argument(
      fmt::format("--device: '{}' is not a device here; valid: cpu, cuda, cuda:N", device));
}

// The GPU's bfloat16 GEMM peak (8192^3, as a linear's forward through
// cuBLASLt) and copy bandwidth.
int run_cuda_peak(const ParsedArgs& parsed, int32_t device) {
  if (parsed.value("threads")) {
    throw invalid_argument("--threads: the CUDA peak runs on the GPU; leave --threads out");
  }
  const auto dtypes = split_list(parsed.value("dtype").value_or("bfloat16"));
  if (dtypes != std::vector<std::string>{"bfloat16"}) {
    throw invalid_argument("--dtype: the CUDA peak measures bfloat16 GEMMs only; valid: bfloat16");
  }
  constexpr int64_t kSize = 8192;
  const train::CudaPeak peak =
      train::measure_cuda_peak(device, kSize, parse_seconds(parsed, "seconds", 2.0));
  if (parsed.has_flag("json")) {
    const nlohmann::ordered_json json = {{"op", "gemm_peak"},
                                         {"dtype", "bfloat16"},
                                         {"device", fmt::format("cuda:{}", device)},
                                         {"device_name", peak.device_name},
                                         {"gemm_size", kSize},
                                         {"flops_per_s", peak.gemm_flops_per_s},
                                         {"copy_bytes_per_s", peak.copy_bytes_per_s}};
    std::puts(json.dump().c_str());
  } else {
    std::printf("gemm peak bfloat16 cuda:%d (%s) %.1f TFLOP/s; device copy %.0f GB/s\n", device,
                peak.device_name.c_str(), peak.gemm_flops_per_s / 1e12,
                peak.copy_bytes_per_s / 1e9);
  }
  return 0;
}

int run_peak(const ParsedArgs& parsed) {
  if (const auto device = cuda_device(parsed)) return run_cuda_peak(parsed, *device);
  const auto cores = int64_t(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t threads =
      parse_int_option("threads", parsed.value("threads").value_or(std::to_string(cores)), 1, 4096);
  const auto dtypes = split_list(parsed.value("dtype").value_or("float32,bfloat16"));
  for (const std::string& dtype : dtypes) {
    if (dtype != "float32" && dtype != "bfloat16") {
      throw invalid_argument(
          fmt::format("--dtype: '{}' has no GEMM peak here; valid: float32, bfloat16", dtype));
    }
  }
  if (dtypes.empty()) throw invalid_argument("--dtype: give float32, bfloat16 or both");
  for (const auto& r : run_peak_bench(dtypes, threads, parse_seconds(parsed, "seconds", 1.0))) {
    if (parsed.has_flag("json")) {
      nlohmann::ordered_json json = {{"op", "gemm_peak"},
                                     {"dtype", r.dtype},
                                     {"threads", r.threads},
                                     {"flops_per_s", r.flops_per_s},
                                     {"flops_per_s_per_thread", r.flops_per_s_per_thread}};
      std::puts(json.dump().c_str());
    } else {
      std::printf("gemm peak %-8s %3lld threads %9.1f GFLOP/s (%.1f per thread)\n", r.dtype.c_str(),
                  static_cast<long long>(r.threads), r.flops_per_s / 1e9,
                  r.flops_per_s_per_thread / 1e9);
    }
  }
  return 0;
}

// Each benchmark's own options (besides --help); another's is refused, not
// ignored.
void refuse_foreign_options(const ParsedArgs& parsed, const std::string& what) {
  static const std::map<std::string, std::set<std::string>> kOptions = {
      {"comm", {"nproc", "ops", "sizes", "dtype", "backend", "seconds", "timeout-minutes", "json"}},
      {"memcpy", {"sizes", "seconds", "json"}},
      {"peak", {"device", "threads", "dtype", "seconds", "json"}}};
  const std::set<std::string>& own = kOptions.at(what);
  std::vector<std::string> given;
  for (const auto& [name, value] : parsed.values) given.push_back(name);
  given.insert(given.end(), parsed.flags.begin(), parsed.flags.end());
  for (const std::string& name : given) {
    if (own.contains(name)) continue;
    std::string valid;
    for (const std::string& option : own) valid += (valid.empty() ? "--" : ", --") + option;
    throw invalid_argument(
        fmt::format("--{}: meshrun bench {} takes no such option; valid: {}", name, what, valid));
  }
}

}  // namespace

int run_bench(const Args& args) {
  try {
    const ParsedArgs parsed = parse_args(args,
                                         {{"nproc", true},
                                          {"device", true},
                                          {"threads", true},
                                          {"ops", true},
                                          {"sizes", true},
                                          {"dtype", true},
                                          {"backend", true},
                                          {"seconds", true},
                                          {"timeout-minutes", true},
                                          {"json", false},
                                          {"help", false}},
                                         "bench");
    if (parsed.has_flag("help")) {
      std::puts(kBenchUsage);
      return 0;
    }
    const std::string what = parsed.positionals.empty() ? "" : parsed.positionals[0];
    if (parsed.positionals.size() != 1 || (what != "comm" && what != "memcpy" && what != "peak")) {
      throw invalid_argument(
          "meshrun bench: expected 'comm', 'memcpy' or 'peak' (meshrun bench --help)");
    }
    refuse_foreign_options(parsed, what);
    if (what == "peak") return run_peak(parsed);
    return what == "comm" ? run_comm(args, parsed) : run_memcpy(parsed);
  } catch (const std::exception& error) {
    return report_error(error);
  }
}

}  // namespace meshrun::cli
