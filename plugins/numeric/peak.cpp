#include "numeric/peak.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <thread>
#include <vector>

#include "numeric/bfloat16.hpp"
#include "numeric/gemm.hpp"

namespace meshrun {
namespace {

using Clock = std::chrono::steady_clock;

// bfloat16 GEMMs without the CPU's bfloat16 instructions are the models'
// float32 fallback (numeric/gemm.hpp), so that is what is measured.
dnnl::memory::data_type operand_type(const std::string& dtype) {
  if (dtype == "float32") return dnnl::memory::data_type::f32;
  if (dtype == "bfloat16") {
    return kernels::bfloat16_matmuls_native() ? dnnl::memory::data_type::bf16
                                              : dnnl::memory::data_type::f32;
  }
  throw std::invalid_argument("gemm peak: dtype \"" + dtype +
                              "\" is not one of \"float32\", \"bfloat16\"");
}

void fill_with_ones(dnnl::memory& memory, dnnl::memory::data_type type, int64_t count) {
  void* data = memory.get_data_handle();
  if (type == dnnl::memory::data_type::f32) {
    std::fill_n(static_cast<float*>(data), count, 1.0f);
  } else {
    std::fill_n(static_cast<uint16_t*>(data), count, uint16_t(0x3f80));  // bfloat16 1.0
  }
}

// Seconds per call of `call`, over at least 3 calls and about `seconds`,
// after one untimed call (oneDNN compiles its kernel on the first).
template <class Call>
double mean_seconds(Call&& call, double seconds) {
  call();
  int64_t done = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  while (done < 3 || elapsed < seconds) {
    call();
    ++done;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return elapsed / double(done);
}

}  // namespace

double gemm_flops_per_s(const std::string& dtype, double seconds, int64_t size) {
  omp_set_num_threads(1);
  const dnnl::memory::data_type type = operand_type(dtype);
  const dnnl::memory::dims square{size, size};
  const dnnl::memory::desc a(square, type, dnnl::memory::format_tag::ab);
  const dnnl::memory::desc c(square, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    const dnnl::matmul matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, a, c), engine));
    // Operands of ones: a GEMM's speed does not depend on the values.
    dnnl::memory a_memory(a, engine), c_memory(c, engine);
    fill_with_ones(a_memory, type, size * size);
    const auto multiply = [&] {
      matmul.execute(
          stream,
          {{DNNL_ARG_SRC, a_memory}, {DNNL_ARG_WEIGHTS, a_memory}, {DNNL_ARG_DST, c_memory}});
      stream.wait();
    };
    return 2.0 * double(size) * double(size) * double(size) / mean_seconds(multiply, seconds);
  } catch (const dnnl::error& error) {
    throw std::runtime_error(std::string("gemm peak: oneDNN failed: ") + error.what());
  }
}

double linear_seconds(const std::string& dtype, int64_t m, int64_t k, int64_t n, double seconds,
                      bool weight_in_bfloat16) {
  operand_type(dtype);
  if (m < 1 || k < 1 || n < 1) throw std::invalid_argument("linear_seconds: sizes must be >= 1");
  kernels::use_one_gemm_thread_by_default();
  const kernels::MatmulPrecisionScope precision(
      dtype == "bfloat16" ? kernels::MatmulPrecision::bfloat16 : kernels::MatmulPrecision::float32);
  // Small values: a GEMM's speed does not depend on them.
  std::vector<float> x(size_t(m * k), 0.5f), w(size_t(n * k), 0.25f), y(size_t(m * n));
  std::vector<float> dx(size_t(m * k)), dw(size_t(n * k), 0.0f);
  std::vector<uint16_t> w_bfloat16;
  if (weight_in_bfloat16) {
    w_bfloat16.resize(w.size());
    kernels::to_bfloat16(w.data(), w_bfloat16.data(), int64_t(w.size()));
  }
  const auto weight = [&](int64_t ld) {
    return weight_in_bfloat16 ? kernels::GemmOperand{nullptr, w_bfloat16.data(), ld}
                              : kernels::GemmOperand{w.data(), nullptr, ld};
  };
  const auto linear = [&] {
    kernels::gemm(false, true, m, n, k, 1.0f, {x.data(), nullptr, k}, weight(k), 0.0f, y.data(), n);
    kernels::gemm(false, false, m, k, n, 1.0f, {y.data(), nullptr, n}, weight(k), 0.0f, dx.data(),
                  k);
    kernels::gemm(true, false, n, k, m, 1.0f, y.data(), n, x.data(), k, 1.0f, dw.data(), k);
  };
  return mean_seconds(linear, seconds);
}

std::vector<PeakResult> run_peak_bench(const std::vector<std::string>& dtypes, int64_t threads,
                                       double seconds) {
  std::vector<PeakResult> results;
  for (const std::string& dtype : dtypes) {
    operand_type(dtype);
    std::vector<double> rates(size_t(threads), 0.0);
    std::vector<std::exception_ptr> failures(static_cast<size_t>(threads));
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        try {
          rates[size_t(t)] = gemm_flops_per_s(dtype, seconds);
        } catch (...) {
          failures[size_t(t)] = std::current_exception();
        }
      });
    }
    for (std::thread& worker : workers) worker.join();
    for (const std::exception_ptr& failure : failures) {
      if (failure) std::rethrow_exception(failure);
    }
    PeakResult result{dtype, threads, 0.0, 0.0};
    for (double rate : rates) result.flops_per_s += rate;
    result.flops_per_s_per_thread = result.flops_per_s / double(threads);
    results.push_back(result);
  }
  return results;
}

}  // namespace meshrun
