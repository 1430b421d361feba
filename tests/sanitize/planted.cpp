// Defects planted on purpose, so that the sanitized test run proves its
// sanitizers report them: a test suite that passes under a sanitizer that
// is not there would prove nothing. One defect per mode; each ends the
// process with the sanitizer's report.
//   planted overflow   a heap buffer read one past its end (ASan)
//   planted ub         a signed integer overflow (UBSan)
//   planted leak       memory dropped after MPI_Init and MPI_Finalize, with
//                      Open MPI's own kept state suppressed (LSan)
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

namespace {

// volatile: the optimizer may not prove the defect away.
volatile int sink = 0;

int read_past_the_end() {
  const auto buffer = std::make_unique<int[]>(8);
  volatile int index = 8;
  return buffer[index];
}

int overflow_int() {
  volatile int value = std::numeric_limits<int>::max();
  return value + 1;
}

void leak_under_mpi(int* argc, char*** argv) {
  MPI_Init(argc, argv);
  auto* dropped = new char[48];
  std::memset(dropped, 1, 48);
  sink = dropped[0];
  dropped = nullptr;
  MPI_Finalize();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: planted overflow|ub|leak\n");
    return 2;
  }
  if (std::strcmp(argv[1], "overflow") == 0) sink = read_past_the_end();
  if (std::strcmp(argv[1], "ub") == 0) sink = overflow_int();
  if (std::strcmp(argv[1], "leak") == 0) leak_under_mpi(&argc, &argv);
  return 0;
}
