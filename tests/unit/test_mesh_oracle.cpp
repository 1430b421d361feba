// MeshContext against an independent brute-force oracle. The oracle lays the
// ranks out by nested loops (a counter incremented in pp, dp_replicate,
// dp_shard, cp, tp order), writes down every axis index by its definition, and
// finds each group by collecting the ranks whose other coordinates are equal.
// It shares no code with mesh.cpp: only the public API is compared against it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "errors.hpp"
#include "mesh/mesh.hpp"

namespace {

using meshrun::Axis;
using meshrun::MeshContext;
using meshrun::MeshFamily;
using meshrun::ParallelismSizes;

// Every world up to 256 ranks; MESHRUN_MESH_ORACLE_MAX_WORLD may lower the
// bound (the quick test tier: 128 ranks, a third of the time under ASan;
// the full sweep goes to 256).
int64_t max_world() {
  const char* value = std::getenv("MESHRUN_MESH_ORACLE_MAX_WORLD");
  return value != nullptr ? std::clamp<int64_t>(std::atoll(value), 1, 256) : 256;
}

constexpr size_t kAxisCount = 10;

constexpr std::array<Axis, kAxisCount> kAllAxes = {
    Axis::pp, Axis::dp_replicate, Axis::dp_shard, Axis::cp,       Axis::tp,
    Axis::dp, Axis::dp_shard_cp,  Axis::dp_cp,    Axis::ep_shard, Axis::ep};

// Positions in a rank's coordinate record. The first five are the mesh
// coordinates; a group is the set of ranks that agree on every coordinate
// that is not part of the axis (for the MoE axes: the same stage and the
// same index on the other MoE axis; without an MoE mesh every rank is alone
// on them, at index 0).
enum Slot : size_t { kPp, kDpr, kDps, kCp, kTp, kDp, kDpsCp, kDpCp, kEpShard, kEp };

struct Factorization {
  int64_t pp, dpr, dps, cp, tp;
  int64_t world() const { return pp * dpr * dps * cp * tp; }
};

std::vector<size_t> other_slots(Axis axis, bool moe) {
  if (!moe && (axis == Axis::ep_shard || axis == Axis::ep)) return {kPp, kDpr, kDps, kCp, kTp};
  switch (axis) {
    case Axis::pp:
      return {kDpr, kDps, kCp, kTp};
    case Axis::dp_replicate:
      return {kPp, kDps, kCp, kTp};
    case Axis::dp_shard:
      return {kPp, kDpr, kCp, kTp};
    case Axis::cp:
      return {kPp, kDpr, kDps, kTp};
    case Axis::tp:
      return {kPp, kDpr, kDps, kCp};
    case Axis::dp:
      return {kPp, kCp, kTp};
    case Axis::dp_shard_cp:
      return {kPp, kDpr, kTp};
    case Axis::dp_cp:
      return {kPp, kTp};
    case Axis::ep_shard:
      return {kPp, kEp};
    case Axis::ep:
      return {kPp, kEpShard};
  }
  return {};
}

struct OracleAxis {
  int64_t size = 0;
  std::vector<int64_t> ranks;       // the groups one after another: by lowest rank, each by index
  std::vector<size_t> group_start;  // where each group begins in `ranks`, plus the end
  std::vector<size_t> group_of_rank;
  bool is_group(size_t g, const std::vector<int64_t>& got) const {
    return std::equal(got.begin(), got.end(),
                      ranks.begin() + static_cast<ptrdiff_t>(group_start[g]),
                      ranks.begin() + static_cast<ptrdiff_t>(group_start[g + 1]));
  }
};

struct Oracle {
  std::vector<std::array<int64_t, kAxisCount>> coords;  // per rank
  std::vector<size_t> slots;                            // the axes worked out
  std::array<OracleAxis, kAxisCount> axes;
};

std::vector<std::array<int64_t, kAxisCount>> oracle_coords(const Factorization& f, int64_t ep) {
  std::vector<std::array<int64_t, kAxisCount>> coords;
  coords.reserve(static_cast<size_t>(f.world()));
  for (int64_t p = 0; p < f.pp; ++p) {
    int64_t local = 0;  // rank within the pipeline stage
    for (int64_t a = 0; a < f.dpr; ++a) {
      for (int64_t b = 0; b < f.dps; ++b) {
        for (int64_t c = 0; c < f.cp; ++c) {
          for (int64_t t = 0; t < f.tp; ++t, ++local) {
            const int64_t dp = a * f.dps + b;
            const int64_t moe_shard = ep > 1 ? local / ep : 0;
            const int64_t moe_index = ep > 1 ? local % ep : 0;
            coords.push_back(
                {p, a, b, c, t, dp, b * f.cp + c, dp * f.cp + c, moe_shard, moe_index});
          }
        }
      }
    }
  }
  return coords;
}

// Groups ranks by their other coordinates, each tuple numbered densely
// (mixed radix over the largest index seen on each slot).
OracleAxis oracle_axis(const std::vector<std::array<int64_t, kAxisCount>>& coords,
                       const std::array<int64_t, kAxisCount>& bound, size_t slot,
                       const std::vector<size_t>& others) {
  // (lowest rank with the same other coordinates, index on the axis, rank)
  std::vector<std::array<int64_t, 3>> entries;
  entries.reserve(coords.size());
  std::vector<int64_t> lowest(coords.size(), -1);
  for (size_t rank = 0; rank < coords.size(); ++rank) {
    size_t key = 0;
    for (size_t other : others) key = key * bound[other] + coords[rank][other];
    if (lowest[key] < 0) lowest[key] = static_cast<int64_t>(rank);
    entries.push_back({lowest[key], coords[rank][slot], static_cast<int64_t>(rank)});
  }
  std::sort(entries.begin(), entries.end());
  OracleAxis axis;
  axis.ranks.reserve(coords.size());
  axis.group_of_rank.resize(coords.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i == 0 || entries[i][0] != entries[i - 1][0]) axis.group_start.push_back(i);
    axis.ranks.push_back(entries[i][2]);
    axis.group_of_rank[static_cast<size_t>(entries[i][2])] = axis.group_start.size() - 1;
  }
  axis.group_start.push_back(entries.size());
  axis.size = static_cast<int64_t>(axis.group_start[1]);
  return axis;
}

// With an MoE mesh only the MoE axes are worked out: the others are those of
// the same factorization without one, which is compared separately.
Oracle make_oracle(const Factorization& f, int64_t ep) {
  Oracle oracle;
  oracle.coords = oracle_coords(f, ep);
  oracle.slots =
      ep > 1 ? std::vector<size_t>{kEpShard, kEp}
             : std::vector<size_t>{kPp, kDpr, kDps, kCp, kTp, kDp, kDpsCp, kDpCp, kEpShard, kEp};
  std::array<int64_t, kAxisCount> bound{};
  for (const auto& c : oracle.coords) {
    for (size_t i = 0; i < kAxisCount; ++i) bound[i] = std::max(bound[i], c[i] + 1);
  }
  for (size_t i : oracle.slots) {
    oracle.axes[i] = oracle_axis(oracle.coords, bound, i, other_slots(kAllAxes[i], ep > 1));
  }
  return oracle;
}

// True when group_ranks(axis, rank) is compared for a rank at `index` of an
// axis of `size`. Asking every member costs world x size per axis; above 64
// ranks the first, middle and last member of each group stand for it (every
// group is still compared whole through group_ranks_by_index).
bool asks_group_of(int64_t world, int64_t index, int64_t size) {
  return world <= 64 || index == 0 || index == size / 2 || index == size - 1;
}

// Every rank's coordinate on every axis the oracle worked out, every group by
// index, and the group of each rank (see asks_group_of). Returns a
// description of the first difference, or "" when there is none.
std::string compare(const MeshContext& mesh, const Oracle& oracle) {
  const auto world = static_cast<int64_t>(oracle.coords.size());
  if (mesh.world_size() != world) return "world_size";
  for (size_t i : oracle.slots) {
    const Axis axis = kAllAxes[i];
    const OracleAxis& expected = oracle.axes[i];
    const std::string name(meshrun::axis_name(axis));
    if (mesh.axis_size(axis) != expected.size) return "axis_size " + name;
    const size_t groups = expected.group_start.size() - 1;
    if (mesh.group_count(axis) != static_cast<int64_t>(groups)) {
      return "group_count " + name;
    }
    for (int64_t rank = 0; rank < world; ++rank) {
      const auto r = static_cast<size_t>(rank);
      if (mesh.coordinate(rank, axis) != oracle.coords[r][i]) {
        return "coordinate " + name + " of rank " + std::to_string(rank);
      }
      if (asks_group_of(world, oracle.coords[r][i], expected.size) &&
          !expected.is_group(expected.group_of_rank[r], mesh.group_ranks(axis, rank))) {
        return "group_ranks " + name + " of rank " + std::to_string(rank);
      }
    }
    for (size_t g = 0; g < groups; ++g) {
      if (!expected.is_group(g, mesh.group_ranks_by_index(axis, static_cast<int64_t>(g)))) {
        return "group_ranks_by_index " + name + " group " + std::to_string(g);
      }
    }
  }
  return "";
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> result;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) result.push_back(d);
  }
  return result;
}

std::vector<Factorization> factorizations(int64_t world) {
  std::vector<Factorization> result;
  for (int64_t pp : divisors(world)) {
    for (int64_t dpr : divisors(world / pp)) {
      for (int64_t dps : divisors(world / pp / dpr)) {
        for (int64_t cp : divisors(world / pp / dpr / dps)) {
          result.push_back({pp, dpr, dps, cp, world / pp / dpr / dps / cp});
        }
      }
    }
  }
  return result;
}

ParallelismSizes sizes_for(const Factorization& f, bool explicit_dp, int64_t ep) {
  ParallelismSizes sizes;
  sizes.dp_size = explicit_dp ? f.dpr * f.dps : 0;
  sizes.dp_replicate_size = f.dpr;
  sizes.tp_size = f.tp;
  sizes.pp_size = f.pp;
  sizes.cp_size = f.cp;
  sizes.ep_size = ep;
  return sizes;
}

// The rules of docs/design.md ("Mesh") for an input that is a factorization of the world.
bool fsdp2_accepts(const Factorization& f) { return f.dpr == 1 || f.dpr < f.dpr * f.dps; }
bool megatron_accepts(const Factorization& f, int64_t ep) {
  return f.pp == 1 && f.dpr == 1 && ep == 1;
}
bool ddp_accepts(const Factorization& f, int64_t ep) {
  return f.pp == 1 && f.dpr == 1 && f.cp == 1 && f.tp == 1 && ep == 1;
}

// Resolves `sizes`; checks that it fails exactly when `accepted` is false and,
// otherwise, that the mesh matches `expected`.
std::string check_family(const ParallelismSizes& sizes, int64_t world, MeshFamily family,
                         bool accepted, const std::function<const Oracle&()>& expected) {
  try {
    const MeshContext mesh = meshrun::resolve_mesh(sizes, world, family);
    if (!accepted) return "accepted an invalid mesh";
    return compare(mesh, expected());
  } catch (const meshrun::Error& error) {
    return accepted ? std::string("rejected a valid mesh: ") + error.what() : "";
  }
}

std::string describe(const Factorization& f, MeshFamily family, bool explicit_dp, int64_t ep) {
  return std::string(meshrun::mesh_family_name(family)) + " world " + std::to_string(f.world()) +
         " (pp " + std::to_string(f.pp) + ", dp_replicate " + std::to_string(f.dpr) +
         ", dp_shard " + std::to_string(f.dps) + ", cp " + std::to_string(f.cp) + ", tp " +
         std::to_string(f.tp) + ") ep " + std::to_string(ep) +
         (explicit_dp ? " explicit dp_size" : " derived dp");
}

// One ep > 1 per factorization, rotating through the divisors of the
// non-pipeline ranks, samples the MoE mesh across the whole range.
int64_t sampled_ep(const Factorization& f, size_t counter) {
  const std::vector<int64_t> choices = divisors(f.world() / f.pp);
  if (choices.size() < 2) return 1;
  return choices[1 + counter % (choices.size() - 1)];
}

}  // namespace

TEST_CASE("mesh matches the brute-force oracle for every factorization of up to 256 ranks",
          "[mesh][oracle]") {
  size_t counter = 0;
  int64_t meshes_compared = 0;
  const int64_t last_world = max_world();
  for (int64_t world = 1; world <= last_world; ++world) {
    for (const Factorization& f : factorizations(world)) {
      const bool explicit_dp = ++counter % 2 == 0;
      const int64_t ep = sampled_ep(f, counter);
      for (int64_t moe : ep > 1 ? std::vector<int64_t>{1, ep} : std::vector<int64_t>{1}) {
        const ParallelismSizes sizes = sizes_for(f, explicit_dp, moe);
        // Each oracle is built once, and only when some family accepts.
        std::optional<Oracle> oracle;
        std::optional<Oracle> ddp_oracle;
        const auto shape_f = [&]() -> const Oracle& {
          if (!oracle) oracle = make_oracle(f, moe);
          return *oracle;
        };
        // DDP replicates everything: its shape is (1, world, 1, 1, 1) whatever f is.
        const auto shape_ddp = [&]() -> const Oracle& {
          if (!ddp_oracle) ddp_oracle = make_oracle({1, world, 1, 1, 1}, moe);
          return *ddp_oracle;
        };
        const struct {
          MeshFamily family;
          bool accepted;
          std::function<const Oracle&()> expected;
        } cases[] = {{MeshFamily::fsdp2, fsdp2_accepts(f), shape_f},
                     {MeshFamily::megatron_fsdp, megatron_accepts(f, moe), shape_f},
                     {MeshFamily::ddp, ddp_accepts(f, moe), shape_ddp}};
        for (const auto& c : cases) {
          // One assertion per difference, not per mesh: Catch's bookkeeping
          // of 90,000 passing assertions took most of the test's time.
          const std::string difference =
              check_family(sizes, world, c.family, c.accepted, c.expected);
          if (!difference.empty())
            FAIL(describe(f, c.family, explicit_dp, moe) + ": " + difference);
          meshes_compared += c.accepted ? 1 : 0;
        }
      }
    }
  }
  // Over 100 accepted meshes per world size on average (18,155 up to 128
  // ranks, over 30,000 up to 256): every family is compared, not skipped.
  CHECK(meshes_compared > 100 * last_world);
}

TEST_CASE("mesh accepts and rejects sizes exactly as the rules say", "[mesh][oracle]") {
  // The rules restated independently, over sizes that need not fit the world.
  const auto expected = [](MeshFamily family, const ParallelismSizes& s, int64_t world) {
    if (world < 1 || s.dp_replicate_size < 1 || s.tp_size < 1 || s.pp_size < 1 || s.cp_size < 1 ||
        s.ep_size < 1) {
      return false;
    }
    if (family == MeshFamily::ddp) {
      return s.tp_size == 1 && s.pp_size == 1 && s.cp_size == 1 && s.ep_size == 1 &&
             s.dp_replicate_size == 1 && (s.dp_size <= 0 || s.dp_size == world);
    }
    if (family == MeshFamily::megatron_fsdp &&
        (s.pp_size > 1 || s.ep_size > 1 || s.dp_replicate_size > 1)) {
      return false;
    }
    const int64_t model = s.tp_size * s.cp_size * s.pp_size;
    if (world % model != 0) return false;
    const int64_t dp = world / model;
    if (s.dp_size > 0 && s.dp_size != dp) return false;
    if (s.dp_replicate_size != 1 && s.dp_replicate_size >= dp) return false;
    if (dp % s.dp_replicate_size != 0) return false;
    return (dp * s.cp_size * s.tp_size) % s.ep_size == 0;
  };
  int64_t accepted = 0;
  int64_t rejected = 0;
  for (MeshFamily family : {MeshFamily::fsdp2, MeshFamily::megatron_fsdp, MeshFamily::ddp}) {
    for (int64_t world = 0; world <= 24; ++world) {
      for (int64_t tp : {0, 1, 2, 3}) {
        for (int64_t cp : {1, 2, 3}) {
          for (int64_t pp : {1, 2, 3}) {
            for (int64_t dpr : {0, 1, 2, 3, 4}) {
              for (int64_t ep : {1, 2, 3}) {
                const int64_t model = std::max<int64_t>(1, tp * cp * pp);
                for (int64_t dp_size :
                     {int64_t{-1}, int64_t{0}, world / model, world / model + 1}) {
                  const ParallelismSizes sizes{dp_size, dpr, tp, pp, cp, ep, false};
                  bool ok = true;
                  try {
                    meshrun::resolve_mesh(sizes, world, family);
                  } catch (const meshrun::Error& error) {
                    ok = false;
                    if (error.code() != MESHRUN_INVALID_ARGUMENT || error.key().empty()) {
                      FAIL("bad error: " << error.what());
                    }
                  }
                  if (ok != expected(family, sizes, world)) {
                    FAIL(meshrun::mesh_family_name(family)
                         << " world " << world << " dp_size " << dp_size << " dp_replicate " << dpr
                         << " tp " << tp << " cp " << cp << " pp " << pp << " ep " << ep
                         << (ok ? ": accepted" : ": rejected"));
                  }
                  (ok ? accepted : rejected) += 1;
                }
              }
            }
          }
        }
      }
    }
  }
  CHECK(accepted > 1000);
  CHECK(rejected > 1000);
}
