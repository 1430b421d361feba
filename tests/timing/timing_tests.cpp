// Time limits on the plain optimized build (Release, what users run): ctest
// runs this program in the plain build only (tests/timing/CMakeLists.txt).
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "mesh/mesh.hpp"
#include "test_schedule_support.hpp"

namespace {

using meshrun::Axis;
using meshrun::MeshContext;
using meshrun::MeshFamily;
using meshrun::ParallelismSizes;
using meshrun::schedule::Schedule;
using schedule_testing::shipped_schedule;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("mesh of 100,000 ranks resolves and answers every coordinate in under a second",
          "[mesh]") {
  const auto start = std::chrono::steady_clock::now();
  // pp 4, dp_replicate 5, dp_shard 25, cp 4, tp 50; ep 8 over 25,000 ranks per stage.
  ParallelismSizes sizes;
  sizes.tp_size = 50;
  sizes.cp_size = 4;
  sizes.pp_size = 4;
  sizes.dp_replicate_size = 5;
  sizes.ep_size = 8;
  const MeshContext mesh = meshrun::resolve_mesh(sizes, 100'000, MeshFamily::fsdp2);
  int64_t checksum = 0;
  for (int64_t rank = 0; rank < mesh.world_size(); ++rank) {
    for (Axis axis : {Axis::pp, Axis::dp_replicate, Axis::dp_shard, Axis::cp, Axis::tp, Axis::dp,
                      Axis::dp_shard_cp, Axis::dp_cp, Axis::ep_shard, Axis::ep}) {
      checksum += mesh.coordinate(rank, axis);
    }
  }
  const double took = seconds_since(start);
  CHECK(mesh.axis_size(Axis::dp_shard) == 25);
  CHECK(mesh.axis_size(Axis::ep_shard) == 3125);
  CHECK(checksum > 0);
  INFO(took << " s");
  CHECK(took < 1.0);
}

TEST_CASE("schedule plugins: pp 64, m 1024 is generated, lowered and validated in under a second",
          "[schedule]") {
  for (const auto& [name, v] : std::vector<std::pair<const char*, int64_t>>{
           {"1f1b", 1}, {"interleaved_1f1b", 2}, {"zbv_zero_bubble", 2}, {"dualpipev", 2}}) {
    const auto start = std::chrono::steady_clock::now();
    const Schedule compute = meshrun::schedule::generate(shipped_schedule(name), 64, v, 1024);
    const Schedule lowered = meshrun::schedule::lower(compute);
    meshrun::schedule::validate(lowered);
    const double took = seconds_since(start);
    INFO(name << ": " << took << " s");
    CHECK(took < 1.0);
  }
}
