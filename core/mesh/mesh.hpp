// The device mesh: AutoModel's ParallelismSizes -> MeshContext.
//
// Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), tp
// fastest, as torch's init_device_mesh does. Flattened axes combine
// neighbouring mesh axes: dp = dp_replicate x dp_shard, dp_shard_cp =
// dp_shard x cp, dp_cp = dp_replicate x dp_shard x cp. With ep_size > 1 each
// pipeline stage's non-pp ranks (dp x cp x tp of them) also form the MoE mesh
// (ep_shard, ep), row-major, ep fastest.
//
// Everything is computed arithmetically from the shape: nothing is
// materialized per rank, so a 100,000-rank mesh resolves in microseconds.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshrun {

enum class MeshFamily : int32_t {
  fsdp2 = 1,          // (pp, dp_replicate, dp_shard, cp, tp) + MoE mesh
  megatron_fsdp = 2,  // (dp, cp, tp): no pp, ep or dp_replicate
  ddp = 3,            // (dp): no tp, pp, cp or ep; all of dp is replication
};

std::string_view mesh_family_name(MeshFamily family);

enum class Axis : int32_t {
  pp = 0,
  dp_replicate,
  dp_shard,
  cp,
  tp,
  dp,           // dp_replicate x dp_shard
  dp_shard_cp,  // dp_shard x cp
  dp_cp,        // dp_replicate x dp_shard x cp
  ep_shard,     // MoE mesh, per pipeline stage
  ep,
};

inline constexpr std::array<Axis, 5> kMeshAxes = {Axis::pp, Axis::dp_replicate, Axis::dp_shard,
                                                  Axis::cp, Axis::tp};
inline constexpr std::array<Axis, 3> kFlattenedAxes = {Axis::dp, Axis::dp_shard_cp, Axis::dp_cp};
inline constexpr std::array<Axis, 2> kMoeAxes = {Axis::ep_shard, Axis::ep};

std::string_view axis_name(Axis axis);
// The axis called `name`, or nullopt. Every name of the enum is accepted.
std::optional<Axis> axis_from_name(std::string_view name);
// Every axis name, for error messages.
std::vector<std::string> all_axis_names();
// The axis called `name`; throws meshrun::Error (NOT_FOUND) naming the valid
// axes, with a "did you mean" for a near miss.
Axis require_axis(std::string_view name);

// What the config asks for (AutoModel's ParallelismSizes). dp_size <= 0 means
// "derive from the world size".
struct ParallelismSizes {
  int64_t dp_size = 0;
  int64_t dp_replicate_size = 1;
  int64_t tp_size = 1;
  int64_t pp_size = 1;
  int64_t cp_size = 1;
  int64_t ep_size = 1;
  // Megatron-FSDP's zero_dp_strategy 0: the data-parallel ranks hold equal
  // replicas (dp_replicate = dp, dp_shard = 1), which it reduces over.
  bool replicate_data_parallel = false;
};

class MeshContext {
 public:
  int64_t world_size() const { return world_size_; }
  MeshFamily family() const { return family_; }
  bool has_moe() const { return ep_ > 1; }

  // Size of any axis; the MoE axes are 1 without an MoE mesh.
  int64_t axis_size(Axis axis) const;
  // Index of `rank` along `axis`; rank must be in [0, world_size).
  int64_t coordinate(int64_t rank, Axis axis) const;
  // world_size / axis_size(axis).
  int64_t group_count(Axis axis) const;
  // Ranks of the `axis` group that holds `rank`, in axis-index order.
  std::vector<int64_t> group_ranks(Axis axis, int64_t rank) const;
  // Ranks of group `group` (groups numbered by their lowest rank).
  std::vector<int64_t> group_ranks_by_index(Axis axis, int64_t group) const;

 private:
  friend MeshContext resolve_mesh(const ParallelismSizes&, int64_t, MeshFamily);

  // Every axis, flattened and MoE ones included, is one row-major dimension of
  // the rank space: index = (rank / stride) % size.
  struct Layout {
    int64_t size;
    int64_t stride;
  };
  Layout layout(Axis axis) const;
  void check_rank(int64_t rank) const;

  int64_t world_size_ = 1;
  MeshFamily family_ = MeshFamily::fsdp2;
  std::array<int64_t, 5> shape_{1, 1, 1, 1, 1};  // pp, dp_replicate, dp_shard, cp, tp
  int64_t ep_shard_ = 1;
  int64_t ep_ = 1;
};

// Applies AutoModel's rules for `family` (docs/design.md, "Mesh") and builds the mesh.
// Throws meshrun::Error (INVALID_ARGUMENT, key() = the main offending key,
// e.g. "distributed.tp_size") whose message names the offending
// key(s) as "distributed.<key>" and the sizes involved, e.g.
// "world_size (8) must be divisible by (tp_size * cp_size * pp_size) (3)".
MeshContext resolve_mesh(const ParallelismSizes& sizes, int64_t world_size, MeshFamily family);

}  // namespace meshrun
