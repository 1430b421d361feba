#include "bench/comm_bench.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "errors.hpp"
#include "meshrun/dtype.hpp"

namespace meshrun {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::pair<BenchOp, const char*> kOps[] = {
    {BenchOp::all_reduce, "all_reduce"},         {BenchOp::all_gather, "all_gather"},
    {BenchOp::reduce_scatter, "reduce_scatter"}, {BenchOp::sendrecv, "sendrecv"},
    {BenchOp::all_to_all, "all_to_all"},
};

// Rank r's input element i: small integers, exact in every dtype, so the
// reference sums are exact for up to 8 ranks even in bfloat16.
double input_value(int64_t rank, int64_t index) {
  return static_cast<double>((rank + 1) * ((index % 7) + 1));
}

// Largest relative error a correct result may carry in `dtype`: exact for
// float32 and integers with these inputs; one rounding for 16-bit floats.
double tolerance(DLDataType dtype) {
  if (dtype.code == kDLBfloat) return 1.0 / 128;
  if (dtype.code == kDLFloat && dtype.bits == 16) return 1.0 / 1024;
  return 0.0;
}

// Zeroed bytes aligned to a cache line, as PyTorch's CPU allocator aligns
// tensors (64 bytes): the peers in tests/bench/ move buffers aligned like
// these, and backends may take faster paths for whole lines.
class LineAlignedBytes {
 public:
  static constexpr size_t kAlignment = 64;

  LineAlignedBytes() = default;
  explicit LineAlignedBytes(size_t bytes)
      : data_(static_cast<unsigned char*>(std::aligned_alloc(
            kAlignment,
            (bytes + kAlignment - 1) / kAlignment * kAlignment + (bytes == 0 ? kAlignment : 0)))),
        size_(bytes) {
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(data_.get(), 0, bytes);
  }

  unsigned char* data() { return data_.get(); }
  const unsigned char* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(unsigned char* bytes) const { std::free(bytes); }
  };
  std::unique_ptr<unsigned char[], Free> data_;
  size_t size_ = 0;
};

// The buffers of one (op, size) case and the reference of its result.
struct BenchCase {
  BenchOp op = BenchOp::all_reduce;
  DLDataType dtype{};
  int64_t send_count = 0;
  int64_t recv_count = 0;
  LineAlignedBytes send;
  LineAlignedBytes recv;
};

BenchCase make_case(BenchOp op, DLDataType dtype, int64_t bytes, int64_t nproc, int64_t rank) {
  BenchCase c;
  c.op = op;
  c.dtype = dtype;
  const int64_t count = std::max<int64_t>(nproc, bytes / static_cast<int64_t>(dtype_bytes(dtype)));
  const int64_t per_rank = count / nproc;
  switch (op) {
    case BenchOp::all_reduce:
    case BenchOp::sendrecv:
      c.send_count = c.recv_count = count;
      break;
    case BenchOp::all_gather:
      c.send_count = per_rank;
      c.recv_count = per_rank * nproc;
      break;
    case BenchOp::reduce_scatter:
      c.send_count = per_rank * nproc;
      c.recv_count = per_rank;
      break;
    case BenchOp::all_to_all:  // a block of per_rank elements to every rank
      c.send_count = c.recv_count = per_rank * nproc;
      break;
  }
  c.send = LineAlignedBytes(c.send_count * dtype_bytes(dtype));
  c.recv = LineAlignedBytes(c.recv_count * dtype_bytes(dtype));
  for (int64_t i = 0; i < c.send_count; ++i) {
    store_element(c.send.data(), dtype, i, input_value(rank, i));
  }
  return c;
}

double expected_value(const BenchCase& c, int64_t nproc, int64_t rank, int64_t index) {
  const int64_t all_ranks_sum = nproc * (nproc + 1) / 2;
  switch (c.op) {
    case BenchOp::all_reduce:
      return static_cast<double>(all_ranks_sum * ((index % 7) + 1));
    case BenchOp::all_gather:
      return input_value(index / c.send_count, index % c.send_count);
    case BenchOp::reduce_scatter:
      return static_cast<double>(all_ranks_sum * (((rank * c.recv_count + index) % 7) + 1));
    case BenchOp::sendrecv:
      return input_value((rank + nproc - 1) % nproc, index);
    case BenchOp::all_to_all: {
      const int64_t block = c.recv_count / nproc;
      return input_value(index / block, rank * block + index % block);
    }
  }
  return 0;
}

bool check_case(const BenchCase& c, int64_t nproc, int64_t rank) {
  const double relative = tolerance(c.dtype);
  for (int64_t i = 0; i < c.recv_count; ++i) {
    const double expected = expected_value(c, nproc, rank, i);
    if (std::abs(load_element(c.recv.data(), c.dtype, i) - expected) > relative * expected) {
      return false;
    }
  }
  return true;
}

void run_once(Communicator& comm, BenchCase& c) {
  FlatTensor send(c.send.data(), c.dtype, c.send_count);
  FlatTensor recv(c.recv.data(), c.dtype, c.recv_count);
  switch (c.op) {
    case BenchOp::all_reduce:
      comm.all_reduce(send.get(), recv.get(), ReduceOp::sum).wait();
      return;
    case BenchOp::all_gather:
      comm.all_gather(send.get(), recv.get()).wait();
      return;
    case BenchOp::reduce_scatter:
      comm.reduce_scatter(send.get(), recv.get(), ReduceOp::sum).wait();
      return;
    case BenchOp::sendrecv: {
      const int64_t n = comm.size();
      Request incoming = comm.recv(recv.get(), (comm.rank() + n - 1) % n);
      Request outgoing = comm.send(send.get(), (comm.rank() + 1) % n);
      outgoing.wait();
      incoming.wait();
      return;
    }
    case BenchOp::all_to_all: {
      const std::vector<int64_t> blocks(size_t(comm.size()), c.send_count / comm.size());
      comm.all_to_all(send.get(), blocks, recv.get(), blocks).wait();
      return;
    }
  }
}

// The maximum of `value` over the ranks of `comm`.
int64_t max_over_ranks(Communicator& comm, int64_t value) {
  FlatTensor tensor(&value, dtype_int64(), 1);
  comm.all_reduce(tensor.get(), ReduceOp::max).wait();
  return value;
}

int64_t elapsed_ns(Clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
}

CommBenchResult measure(Communicator& comm, BenchOp op, int64_t bytes,
                        const CommBenchOptions& options) {
  BenchCase c = make_case(op, options.dtype, bytes, comm.size(), comm.rank());
  auto warm_start = Clock::now();
  for (int64_t i = 0; i < options.warmup; ++i) run_once(comm, c);
  const int64_t warm_ns =
      std::max<int64_t>(1, elapsed_ns(warm_start) / std::max<int64_t>(1, options.warmup));
  const int64_t iterations = max_over_ranks(
      comm,
      std::clamp<int64_t>(static_cast<int64_t>(options.seconds_per_size * 1e9 / warm_ns), 3, 2000));
  comm.barrier().wait();
  const auto start = Clock::now();
  for (int64_t i = 0; i < iterations; ++i) run_once(comm, c);
  const int64_t total_ns = max_over_ranks(comm, elapsed_ns(start));
  const bool correct = max_over_ranks(comm, check_case(c, comm.size(), comm.rank()) ? 0 : 1) == 0;

  CommBenchResult result;
  result.op = bench_op_name(op);
  result.dtype = dtype_name(options.dtype);
  result.nproc = comm.size();
  result.bytes = static_cast<int64_t>((op == BenchOp::all_gather ? c.recv.size() : c.send.size()));
  result.time_us = static_cast<double>(total_ns) / 1e3 / static_cast<double>(iterations);
  result.algbw_gbps = static_cast<double>(result.bytes) / (result.time_us * 1e3);
  result.busbw_gbps = bus_bandwidth(op, comm.size(), result.algbw_gbps);
  result.correct = correct;
  return result;
}

}  // namespace

BenchOp bench_op_from_name(const std::string& name) {
  std::string names;
  for (const auto& [op, op_name] : kOps) {
    if (name == op_name) return op;
    names += names.empty() ? op_name : std::string(", ") + op_name;
  }
  throw invalid_argument(fmt::format("--ops: unknown operation '{}'; valid: {}", name, names));
}

std::string bench_op_name(BenchOp op) {
  for (const auto& [known, name] : kOps) {
    if (known == op) return name;
  }
  return "unknown";
}

int64_t parse_byte_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string suffix = text.substr(digits);
  int64_t scale = 0;
  if (suffix.empty() || suffix == "B") scale = 1;
  if (suffix == "K" || suffix == "KiB") scale = int64_t{1} << 10;
  if (suffix == "M" || suffix == "MiB") scale = int64_t{1} << 20;
  if (suffix == "G" || suffix == "GiB") scale = int64_t{1} << 30;
  if (digits == 0 || digits > 12 || scale == 0) {
    throw invalid_argument(fmt::format(
        "--sizes: '{}' is not a size; write a number with an optional K, M or G suffix (64K, 16M)",
        text));
  }
  constexpr int64_t kLargest = int64_t{4} << 30;
  const int64_t count = std::stoll(text.substr(0, digits));
  if (count < 1 || count > kLargest / scale) {
    throw invalid_argument(fmt::format("--sizes: '{}' must be between 1 byte and 4G", text));
  }
  return count * scale;
}

double bus_bandwidth(BenchOp op, int64_t nproc, double algbw) {
  const double n = static_cast<double>(nproc);
  switch (op) {
    case BenchOp::all_reduce:
      return algbw * 2 * (n - 1) / n;
    case BenchOp::all_gather:
    case BenchOp::reduce_scatter:
    case BenchOp::all_to_all:
      return algbw * (n - 1) / n;
    case BenchOp::sendrecv:
      return algbw;
  }
  return algbw;
}

std::vector<CommBenchResult> run_comm_bench(Communicator& world, const CommBenchOptions& options) {
  std::vector<CommBenchResult> results;
  for (BenchOp op : options.ops) {
    for (int64_t bytes : options.sizes) results.push_back(measure(world, op, bytes, options));
  }
  return results;
}

std::vector<MemcpyResult> run_memcpy_bench(const std::vector<int64_t>& sizes,
                                           double seconds_per_size) {
  std::vector<MemcpyResult> results;
  for (int64_t bytes : sizes) {
    std::vector<unsigned char> from(bytes, 1), to(bytes, 2);
    std::memcpy(to.data(), from.data(), bytes);
    auto start = Clock::now();
    std::memcpy(to.data(), from.data(), bytes);
    const int64_t once = std::max<int64_t>(1, elapsed_ns(start));
    const int64_t iterations =
        std::clamp<int64_t>(static_cast<int64_t>(seconds_per_size * 1e9 / once), 3, 100000);
    start = Clock::now();
    for (int64_t i = 0; i < iterations; ++i) {
      std::memcpy(to.data(), from.data(), bytes);
      from[i % bytes] = to[(i * 7) % bytes];  // keeps the copies from being elided
    }
    MemcpyResult result;
    result.bytes = bytes;
    result.time_us = static_cast<double>(elapsed_ns(start)) / 1e3 / static_cast<double>(iterations);
    result.gbps = static_cast<double>(bytes) / (result.time_us * 1e3);
    results.push_back(result);
  }
  return results;
}

}  // namespace meshrun
