// One test per mesh validation rule of docs/design.md ("Mesh"): the message names
// the keys and sizes involved, and key() the main offending key.
#include <cstdint>
#include <limits>
#include <string>

#include <catch2/catch.hpp>

#include "errors.hpp"
#include "mesh/mesh.hpp"

namespace {

using Catch::Contains;
using meshrun::Axis;
using meshrun::MeshContext;
using meshrun::MeshFamily;
using meshrun::ParallelismSizes;
using meshrun::resolve_mesh;

constexpr int64_t kHuge = std::numeric_limits<int64_t>::max();

ParallelismSizes sizes_with(int64_t tp, int64_t cp = 1, int64_t pp = 1, int64_t dp_replicate = 1,
                            int64_t ep = 1, int64_t dp = 0) {
  ParallelismSizes sizes;
  sizes.dp_size = dp;
  sizes.dp_replicate_size = dp_replicate;
  sizes.tp_size = tp;
  sizes.pp_size = pp;
  sizes.cp_size = cp;
  sizes.ep_size = ep;
  return sizes;
}

// The key() of the error resolve_mesh throws, or "no error".
std::string error_key(const ParallelismSizes& sizes, int64_t world, MeshFamily family) {
  try {
    resolve_mesh(sizes, world, family);
  } catch (const meshrun::Error& error) {
    CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
    CHECK(error.is_input_error());
    return error.key();
  }
  return "no error";
}

}  // namespace

TEST_CASE("mesh rule: world_size must be at least 1", "[mesh][rules]") {
  for (int64_t world : {int64_t{0}, int64_t{-3}}) {
    REQUIRE_THROWS_WITH(resolve_mesh({}, world, MeshFamily::fsdp2),
                        Contains("world_size (" + std::to_string(world) + ") must be >= 1"));
    CHECK(error_key({}, world, MeshFamily::fsdp2) == "world_size");
  }
}

TEST_CASE("mesh rule: every size but dp_size must be at least 1", "[mesh][rules]") {
  const struct {
    const char* key;
    ParallelismSizes sizes;
  } cases[] = {{"dp_replicate_size", sizes_with(1, 1, 1, 0)},
               {"tp_size", sizes_with(0)},
               {"pp_size", sizes_with(1, 1, -2)},
               {"cp_size", sizes_with(1, 0)},
               {"ep_size", sizes_with(1, 1, 1, 1, 0)}};
  for (MeshFamily family : {MeshFamily::fsdp2, MeshFamily::megatron_fsdp, MeshFamily::ddp}) {
    for (const auto& c : cases) {
      INFO(c.key);
      REQUIRE_THROWS_WITH(
          resolve_mesh(c.sizes, 8, family),
          Contains(std::string("distributed.") + c.key + " (") && Contains(") must be >= 1"));
      CHECK(error_key(c.sizes, 8, family) == std::string("distributed.") + c.key);
    }
  }
  // dp_size <= 0 means "derive it".
  CHECK(resolve_mesh(sizes_with(2, 1, 1, 1, 1, -5), 8, MeshFamily::fsdp2).axis_size(Axis::dp) == 4);
}

TEST_CASE("mesh rule: fsdp2 world_size divisible by tp * cp * pp", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(
      resolve_mesh(sizes_with(3), 8, MeshFamily::fsdp2),
      Contains("world_size (8) must be divisible by (tp_size * cp_size * pp_size) (3)") &&
          Contains("distributed.tp_size = 3") && Contains("distributed.cp_size = 1") &&
          Contains("distributed.pp_size = 1"));
  CHECK(error_key(sizes_with(3), 8, MeshFamily::fsdp2) == "distributed.tp_size");
  // Each size divides 8 but the product does not: the one that tips it is named.
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(4, 1, 4), 8, MeshFamily::fsdp2),
                      Contains("(tp_size * cp_size * pp_size) (16)"));
  CHECK(error_key(sizes_with(4, 1, 4), 8, MeshFamily::fsdp2) == "distributed.pp_size");
  CHECK(error_key(sizes_with(2, 3), 8, MeshFamily::fsdp2) == "distributed.cp_size");
}

TEST_CASE("mesh rule: explicit dp_size must agree with the world size", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(2, 1, 1, 1, 1, 3), 8, MeshFamily::fsdp2),
                      Contains("distributed.dp_size (3) does not fit world_size (8)") &&
                          Contains("dp_size * (tp_size * cp_size * pp_size) = 3 * 2 = 6") &&
                          Contains("derive dp = 4"));
  CHECK(error_key(sizes_with(2, 1, 1, 1, 1, 3), 8, MeshFamily::fsdp2) == "distributed.dp_size");
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(2, 1, 1, 1, 1, 2), 8, MeshFamily::megatron_fsdp),
                      Contains("dp_size * (tp_size * cp_size) = 2 * 2 = 4, not 8"));
  CHECK(error_key(sizes_with(2, 1, 1, 1, 1, 2), 8, MeshFamily::megatron_fsdp) ==
        "distributed.dp_size");
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(1, 1, 1, 1, 1, 4), 8, MeshFamily::ddp),
                      Contains("distributed.dp_size (4) does not fit world_size (8): dp_size = 4"));
  CHECK(error_key(sizes_with(1, 1, 1, 1, 1, 4), 8, MeshFamily::ddp) == "distributed.dp_size");
  CHECK(resolve_mesh(sizes_with(2, 1, 1, 1, 1, 4), 8, MeshFamily::fsdp2).axis_size(Axis::dp) == 4);
}

TEST_CASE("mesh rule: dp must be divisible by dp_replicate_size", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(1, 1, 1, 3), 8, MeshFamily::fsdp2),
                      Contains("dp (8) must be divisible by distributed.dp_replicate_size (3)"));
  CHECK(error_key(sizes_with(1, 1, 1, 3), 8, MeshFamily::fsdp2) == "distributed.dp_replicate_size");
}

TEST_CASE("mesh rule: fsdp2 dp_replicate_size must be less than dp", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(2, 1, 1, 4), 8, MeshFamily::fsdp2),
                      Contains("distributed.dp_replicate_size (4) must be less than dp (4)") &&
                          Contains("pure replication is DDP's job"));
  CHECK(error_key(sizes_with(2, 1, 1, 4), 8, MeshFamily::fsdp2) == "distributed.dp_replicate_size");
  CHECK_NOTHROW(resolve_mesh(sizes_with(8), 8, MeshFamily::fsdp2));  // dp 1, replicate 1
}

TEST_CASE("mesh rule: fsdp2 MoE needs dp * cp * tp to be a multiple of ep_size", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(3, 1, 2, 1, 4), 12, MeshFamily::fsdp2),
                      Contains("dp * cp * tp (6 ranks per pipeline stage)") &&
                          Contains("must be a multiple of distributed.ep_size (4)"));
  CHECK(error_key(sizes_with(3, 1, 2, 1, 4), 12, MeshFamily::fsdp2) == "distributed.ep_size");
  const MeshContext mesh = resolve_mesh(sizes_with(3, 1, 2, 1, 6), 12, MeshFamily::fsdp2);
  CHECK(mesh.has_moe());
  CHECK(mesh.axis_size(Axis::ep_shard) == 1);
  CHECK(mesh.axis_size(Axis::ep) == 6);
}

TEST_CASE("mesh rule: megatron_fsdp has no pp, ep or dp_replicate", "[mesh][rules]") {
  const struct {
    const char* key;
    ParallelismSizes sizes;
    const char* message;
  } cases[] = {{"pp_size", sizes_with(1, 1, 2), "distributed.pp_size (2) must be 1"},
               {"ep_size", sizes_with(1, 1, 1, 1, 2), "distributed.ep_size (2) must be 1"},
               {"dp_replicate_size", sizes_with(1, 1, 1, 2), "no HSDP"}};
  for (const auto& c : cases) {
    INFO(c.key);
    REQUIRE_THROWS_WITH(resolve_mesh(c.sizes, 8, MeshFamily::megatron_fsdp),
                        Contains(c.message) && Contains("megatron_fsdp"));
    CHECK(error_key(c.sizes, 8, MeshFamily::megatron_fsdp) == std::string("distributed.") + c.key);
  }
}

TEST_CASE("mesh rule: megatron_fsdp world_size divisible by tp * cp", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(2, 3), 8, MeshFamily::megatron_fsdp),
                      Contains("world_size (8) must be divisible by (tp_size * cp_size) (6)") &&
                          Contains("distributed.cp_size = 3"));
  CHECK(error_key(sizes_with(2, 3), 8, MeshFamily::megatron_fsdp) == "distributed.cp_size");
  const MeshContext mesh = resolve_mesh(sizes_with(2, 2), 8, MeshFamily::megatron_fsdp);
  CHECK(mesh.axis_size(Axis::pp) == 1);
  CHECK(mesh.axis_size(Axis::dp_replicate) == 1);
  CHECK(mesh.axis_size(Axis::dp_shard) == 2);
}

TEST_CASE("mesh rule: ddp has no tp, pp, cp or ep", "[mesh][rules]") {
  const struct {
    const char* key;
    ParallelismSizes sizes;
  } cases[] = {{"tp_size", sizes_with(2)},
               {"pp_size", sizes_with(1, 1, 2)},
               {"cp_size", sizes_with(1, 2)},
               {"ep_size", sizes_with(1, 1, 1, 1, 2)}};
  for (const auto& c : cases) {
    INFO(c.key);
    REQUIRE_THROWS_WITH(resolve_mesh(c.sizes, 8, MeshFamily::ddp),
                        Contains(std::string("distributed.") + c.key + " (2) must be 1") &&
                            Contains("strategy ddp"));
    CHECK(error_key(c.sizes, 8, MeshFamily::ddp) == std::string("distributed.") + c.key);
  }
  const MeshContext mesh = resolve_mesh({}, 8, MeshFamily::ddp);
  CHECK(mesh.axis_size(Axis::dp_replicate) == 8);
  CHECK(mesh.axis_size(Axis::dp_shard) == 1);
}

TEST_CASE("mesh rule: ddp dp_replicate_size > 1 only with fsdp2", "[mesh][rules]") {
  REQUIRE_THROWS_WITH(
      resolve_mesh(sizes_with(1, 1, 1, 2), 8, MeshFamily::ddp),
      Contains("distributed.dp_replicate_size (2) must be 1") && Contains("only with fsdp2"));
  CHECK(error_key(sizes_with(1, 1, 1, 2), 8, MeshFamily::ddp) == "distributed.dp_replicate_size");
}

TEST_CASE("mesh rule: huge sizes error instead of overflowing", "[mesh][rules]") {
  const int64_t big = int64_t{1} << 32;
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(big, big, big), 8, MeshFamily::fsdp2),
                      Contains("(tp_size * cp_size * pp_size) (more than 9223372036854775807)"));
  CHECK(error_key(sizes_with(big, big, big), 8, MeshFamily::fsdp2) == "distributed.tp_size");
  CHECK(error_key(sizes_with(kHuge, kHuge), 8, MeshFamily::megatron_fsdp) == "distributed.tp_size");
  REQUIRE_THROWS_WITH(resolve_mesh(sizes_with(2, 1, 1, 1, 1, kHuge), 8, MeshFamily::fsdp2),
                      Contains("= more than 9223372036854775807"));
  CHECK(error_key(sizes_with(1, 1, 1, kHuge), 8, MeshFamily::fsdp2) ==
        "distributed.dp_replicate_size");
  CHECK(error_key(sizes_with(1, 1, 1, 1, kHuge), 8, MeshFamily::fsdp2) == "distributed.ep_size");
  const MeshContext mesh = resolve_mesh({}, kHuge, MeshFamily::fsdp2);
  CHECK(mesh.coordinate(kHuge - 1, Axis::dp_shard) == kHuge - 1);
  CHECK(mesh.group_ranks_by_index(Axis::tp, kHuge - 1) == std::vector<int64_t>{kHuge - 1});
}

TEST_CASE("mesh queries reject out-of-range ranks, groups and axes", "[mesh][rules]") {
  const MeshContext mesh = resolve_mesh(sizes_with(2), 8, MeshFamily::fsdp2);
  const auto out_of_range = [](auto&& query) {
    try {
      query();
    } catch (const meshrun::Error& error) {
      return error.code() == MESHRUN_OUT_OF_RANGE;
    }
    return false;
  };
  CHECK(out_of_range([&] { mesh.coordinate(8, Axis::tp); }));
  CHECK(out_of_range([&] { mesh.coordinate(-1, Axis::pp); }));
  CHECK(out_of_range([&] { mesh.group_ranks(Axis::dp, 8); }));
  CHECK(out_of_range([&] { mesh.group_ranks_by_index(Axis::tp, 4); }));
  CHECK(out_of_range([&] { mesh.group_ranks_by_index(Axis::dp, -1); }));
  REQUIRE_THROWS_WITH(mesh.coordinate(8, Axis::tp), Contains("rank 8") && Contains("8"));
  REQUIRE_THROWS_WITH(mesh.group_ranks_by_index(Axis::tp, 4),
                      Contains("group 4 of axis tp") && Contains("4 groups"));
  CHECK_THROWS_AS(mesh.axis_size(static_cast<Axis>(42)), meshrun::Error);
}

TEST_CASE("mesh axis names round-trip and unknown names suggest the nearest", "[mesh][rules]") {
  for (const std::string& name : meshrun::all_axis_names()) {
    const auto axis = meshrun::axis_from_name(name);
    REQUIRE(axis);
    CHECK(meshrun::axis_name(*axis) == name);
    CHECK(meshrun::require_axis(name) == *axis);
  }
  CHECK_FALSE(meshrun::axis_from_name("dp_shard_tp"));
  REQUIRE_THROWS_WITH(meshrun::require_axis("dp_shrd"), Contains("unknown mesh axis 'dp_shrd'") &&
                                                            Contains("did you mean 'dp_shard'?") &&
                                                            Contains("dp_cp, ep_shard, ep"));
  CHECK(meshrun::mesh_family_name(MeshFamily::megatron_fsdp) == "megatron_fsdp");
}

TEST_CASE("mesh rule: megatron_fsdp's zero_dp_strategy 0 replicates over dp", "[mesh][rules]") {
  ParallelismSizes sizes = sizes_with(2);
  sizes.replicate_data_parallel = true;
  const MeshContext mesh = resolve_mesh(sizes, 8, MeshFamily::megatron_fsdp);
  CHECK(mesh.axis_size(Axis::dp) == 4);
  CHECK(mesh.axis_size(Axis::dp_replicate) == 4);
  CHECK(mesh.axis_size(Axis::dp_shard) == 1);
  CHECK(mesh.axis_size(Axis::dp_shard_cp) == 1);
  CHECK(mesh.axis_size(Axis::tp) == 2);
  sizes.cp_size = 2;
  REQUIRE_THROWS_WITH(resolve_mesh(sizes, 8, MeshFamily::megatron_fsdp),
                      Contains("distributed.cp_size (2) must be 1 with zero_dp_strategy 0"));
  CHECK(error_key(sizes, 8, MeshFamily::megatron_fsdp) == "distributed.cp_size");
}
