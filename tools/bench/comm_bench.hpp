// `meshrun bench comm` and `meshrun bench memcpy`: nccl-tests-style
// measurements of the comm backend's collectives, every result checked
// against a locally computed reference, and the single-core memcpy
// bandwidth that bounds shared-memory collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "comm/comm.hpp"

namespace meshrun {

enum class BenchOp { all_reduce, all_gather, reduce_scatter, sendrecv, all_to_all };

struct CommBenchOptions {
  std::vector<BenchOp> ops;
  std::vector<int64_t> sizes;  // bytes, nccl-tests conventions
  DLDataType dtype = dtype_float32();
  int64_t warmup = 2;
  double seconds_per_size = 0.3;  // iterations are chosen to take about this long
};

struct CommBenchResult {
  std::string op;
  std::string dtype;
  int64_t nproc = 0;
  int64_t bytes = 0;
  double time_us = 0;  // slowest rank's mean time per iteration
  double algbw_gbps = 0;
  double busbw_gbps = 0;
  bool correct = false;
};

BenchOp bench_op_from_name(const std::string& name);
std::string bench_op_name(BenchOp op);
// "64K", "1M", "16M", "1G" or a plain byte count.
int64_t parse_byte_size(const std::string& text);

// Collective over `world`: every rank runs every (op, size); the results
// (identical on every rank) are returned.
std::vector<CommBenchResult> run_comm_bench(Communicator& world, const CommBenchOptions& options);

// busbw for `op` on n ranks from algbw (nccl-tests' factors).
double bus_bandwidth(BenchOp op, int64_t nproc, double algbw);

struct MemcpyResult {
  int64_t bytes = 0;
  double time_us = 0;
  double gbps = 0;  // bytes copied per second
};

// Single-core memcpy bandwidth between two buffers of each size.
std::vector<MemcpyResult> run_memcpy_bench(const std::vector<int64_t>& sizes,
                                           double seconds_per_size);

}  // namespace meshrun
