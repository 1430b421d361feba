// Fuzz target: pipeline schedules from CSV (pp_schedule_csv, meshrun
// schedule --csv). The first byte picks the pipeline the file must fit, the
// rest is the file.
#include "fuzz_input.hpp"
#include "schedule/schedule.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int64_t pp = 1 + data[0] % 4;
  const int64_t stages_per_rank = 1 + (data[0] >> 2) % 2;
  const int64_t microbatches = 1 + (data[0] >> 3) % 8;
  const std::string path = meshrun::fuzz::write_input("schedule.csv", data + 1, size - 1);
  meshrun::fuzz::refuse_or_accept(
      [&] { meshrun::schedule::read_csv(path, pp, stages_per_rank, microbatches); });
  return 0;
}
