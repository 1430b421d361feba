// How fsdp2 shards parameters (PyTorch FSDP2's dim-0 sharding): a pure
// function of the parameter layout, the units and the shard group, kept
// apart from the plugin so that it can be tested without processes.
//
// Parameter p of R rows, each of S elements, is cut into chunks of
// c = ceil(R / W) rows over the W ranks of the shard group: rank r holds
// rows [r c, min((r + 1) c, R)), padded with zeros to c S elements, so every
// rank's chunk of p has the same size. The local shard holds this rank's
// chunks unit by unit (in unit index order) and, within a unit, parameter by
// parameter (in index order): a unit's chunks form one contiguous block, of
// the same size on every rank, which is what one all-gather moves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "meshrun/strategy.h"

namespace meshrun::sharding {

// Where one parameter lives: in the setup's flat layout, in the local shard
// and in its unit's full (gathered) buffer.
struct ParameterPlace {
  int64_t parameter = 0;     // index into the setup's parameters
  int64_t numel = 0;         // elements of the full parameter
  int64_t chunk = 0;         // elements of one rank's padded chunk
  int64_t global_begin = 0;  // in the setup's layout
  int64_t block_begin = 0;   // of the chunk within its unit's block
  int64_t unit_begin = 0;    // of the full parameter within the unit's buffer

  // Elements of rank `rank`'s chunk that are parameter elements; the rest of
  // the chunk is padding.
  int64_t filled(int64_t rank) const { return std::clamp(numel - rank * chunk, int64_t{0}, chunk); }
};

// One unit: its parameters in index order, its block of the local shard and
// the size of its full buffer.
struct UnitPlace {
  std::vector<ParameterPlace> parameters;
  int64_t local_begin = 0;  // of the block in the local shard
  int64_t block_numel = 0;  // the block: the sum of the chunks
  int64_t full_numel = 0;   // the full buffer: the sum of the parameters
};

// What the layout is computed from, as the setup gives it (checked).
struct LayoutInput {
  std::vector<int64_t> offsets;  // num_parameters + 1 element offsets
  std::vector<int64_t> rows;     // dim 0 of each parameter; divides its numel
  std::vector<int32_t> units;    // unit of each parameter, in [0, num_units)
  int32_t num_units = 0;
};

class ShardLayout {
 public:
  // The layout of rank `rank` of a shard group of `ranks` ranks.
  ShardLayout(const LayoutInput& input, int64_t ranks, int64_t rank);

  int64_t ranks() const { return ranks_; }
  int64_t rank() const { return rank_; }
  int32_t num_units() const { return static_cast<int32_t>(units_.size()); }
  const UnitPlace& unit(int32_t u) const { return units_[static_cast<size_t>(u)]; }
  // Elements of the local shard: the sum of the unit blocks.
  int64_t local_numel() const { return local_numel_; }

  // This rank's pieces of the parameters, in local order (meshrun/strategy.h).
  std::vector<meshrun_shard_segment> segments() const;
  // Writes this rank's parts of elements [begin, begin + count) of the
  // setup's layout, held at `piece`, into `local` (local_numel() elements);
  // padding is left as it is.
  void shard(const float* piece, int64_t begin, int64_t count, float* local) const;
  // Writes every parameter into `full` (the setup's layout) from `gathered`:
  // every rank's local shard, ranks() x local_numel() elements, rank order.
  void unshard(const float* gathered, float* full) const;

 private:
  int64_t ranks_;
  int64_t rank_;
  std::vector<UnitPlace> units_;
  int64_t local_numel_ = 0;
};

}  // namespace meshrun::sharding
