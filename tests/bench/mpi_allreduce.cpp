// The raw MPI peer of the collective benchmarks: MPI_Allreduce of float32
// sums on MPI_COMM_WORLD, each size as one message, timed as `meshrun bench
// comm` times its own (nccl-tests' busbw = algbw * 2 (n - 1) / n, the
// slowest rank's mean time). Prints one JSON line per size.
//
//   mpirun -np 4 meshrun-mpi-allreduce-bench --sizes 1M,64M [--seconds 0.3]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

long long parse_size(const std::string& text) {
  const char unit = text.empty() ? '\0' : text.back();
  const long long value = std::atoll(text.c_str());
  if (unit == 'K') return value << 10;
  if (unit == 'M') return value << 20;
  if (unit == 'G') return value << 30;
  return value;
}

std::vector<long long> parse_sizes(const std::string& list) {
  std::vector<long long> sizes;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    sizes.push_back(parse_size(list.substr(start, end - start)));
    start = end + 1;
  }
  return sizes;
}

// Mean seconds per MPI_Allreduce over enough iterations to fill `seconds`,
// the slowest rank's.
double time_all_reduce(std::vector<float>& send, std::vector<float>& recv, double seconds) {
  const int count = static_cast<int>(send.size());
  for (int warmup = 0; warmup < 2; ++warmup) {
    MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  double once = MPI_Wtime();
  MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  once = MPI_Wtime() - once;
  MPI_Allreduce(MPI_IN_PLACE, &once, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const int iterations = std::max(1, static_cast<int>(seconds / std::max(once, 1e-6)));
  MPI_Barrier(MPI_COMM_WORLD);
  double elapsed = MPI_Wtime();
  for (int i = 0; i < iterations; ++i) {
    MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  elapsed = MPI_Wtime() - elapsed;
  MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return elapsed / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::string sizes = "1M,16M,64M";
  double seconds = 0.3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string option = argv[i];
    if (option == "--sizes") sizes = argv[i + 1];
    if (option == "--seconds") seconds = std::atof(argv[i + 1]);
  }
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  bool correct = true;
  for (const long long bytes : parse_sizes(sizes)) {
    const size_t count = static_cast<size_t>(bytes) / sizeof(float);
    std::vector<float> send(count, static_cast<float>(rank + 1)), recv(count, 0.0f);
    const double time = time_all_reduce(send, recv, seconds);
    const float expected = static_cast<float>(ranks * (ranks + 1) / 2);
    correct =
        correct && std::all_of(recv.begin(), recv.end(), [&](float v) { return v == expected; });
    const double algbw = static_cast<double>(bytes) / time / 1e9;
    if (rank == 0) {
      std::printf(
          "{\"op\": \"all_reduce\", \"nproc\": %d, \"bytes\": %lld, \"time_us\": %.1f, "
          "\"busbw_gbps\": %.4f, \"correct\": %s}\n",
          ranks, bytes, time * 1e6, algbw * 2.0 * (ranks - 1) / ranks, correct ? "true" : "false");
    }
  }
  MPI_Finalize();
  return correct ? 0 : 1;
}
