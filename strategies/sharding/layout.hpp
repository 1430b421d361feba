// How the sharded strategies shard parameters: flat, per block, as
// Megatron-FSDP, DeepSpeed ZeRO-3 and FSDP1's FlatParameter do. A pure
// function of the parameter layout, the units and the shard group, kept
// apart from the plugins so that it can be tested without processes.
//
// A block is what one all-gather and one reduce-scatter move: a unit, or
// with one_block every unit. Its parameters, units in unit order and each
// unit's parameters in index order, laid end to end are its full buffer of
// F elements; padded with zeros to W c elements, c = ceil(F / W), it is cut
// into W chunks of c elements, and rank r of the shard group holds chunk r.
// The local shard holds this rank's chunks block by block.
//
// So the W chunks an all-gather receives, rank after rank, are the full
// buffer itself, and the full gradients are the reduce-scatter's send
// buffer as they are: no copy between the collectives and the buffers the
// model computes with. A parameter may straddle two ranks' chunks; the
// segments (meshrun/strategy.h) say which of its elements a rank holds.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "meshrun/strategy.h"

namespace meshrun::sharding {

// Where one parameter lives: in the setup's flat layout and in its block's
// full buffer.
struct ParameterPlace {
  int64_t parameter = 0;     // index into the setup's parameters
  int64_t numel = 0;         // elements of the full parameter
  int64_t global_begin = 0;  // in the setup's layout
  int64_t block_begin = 0;   // in the block's full buffer
};

// One block: its parameters in full-buffer order, its chunk of the local
// shard and the size of its full buffer.
struct BlockPlace {
  std::vector<ParameterPlace> parameters;
  int64_t local_begin = 0;   // of this rank's chunk in the local shard
  int64_t chunk = 0;         // elements each rank holds: ceil(full_numel / ranks)
  int64_t full_numel = 0;    // the sum of the parameters
  int64_t padded_numel = 0;  // ranks x chunk: the gathered buffer
};

// Where one unit's parameters lie: elements [begin, begin + numel) of its
// block's full buffer.
struct UnitSpan {
  int32_t block = 0;
  int64_t begin = 0;
  int64_t numel = 0;
};

// What the layout is computed from, as the setup gives it (checked).
struct LayoutInput {
  std::vector<int64_t> offsets;  // num_parameters + 1 element offsets
  std::vector<int32_t> units;    // unit of each parameter, in [0, num_units)
  int32_t num_units = 0;
  bool one_block = false;  // every unit in one block; else a block per unit
};

// to[i] = from[i] for `count` floats, wherever the layout's buffers live.
using CopyFloats = std::function<void(float* to, const float* from, int64_t count)>;
// CopyFloats for host memory (memcpy).
void copy_host_floats(float* to, const float* from, int64_t count);

class ShardLayout {
 public:
  // The layout of rank `rank` of a shard group of `ranks` ranks.
  ShardLayout(const LayoutInput& input, int64_t ranks, int64_t rank);

  int64_t ranks() const { return ranks_; }
  int64_t rank() const { return rank_; }
  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  const BlockPlace& block(int32_t b) const { return blocks_[static_cast<size_t>(b)]; }
  int32_t num_units() const { return static_cast<int32_t>(units_.size()); }
  const UnitSpan& unit(int32_t u) const { return units_[static_cast<size_t>(u)]; }
  // Elements of the local shard: the sum of the chunks.
  int64_t local_numel() const { return local_numel_; }

  // This rank's pieces of the parameters, in local order (meshrun/strategy.h).
  std::vector<meshrun_shard_segment> segments() const { return segments_of(rank_); }
  // Writes this rank's parts of elements [begin, begin + count) of the
  // setup's layout, held at `piece`, into `local` (local_numel() elements);
  // padding is left as it is. `copy` moves each contiguous part.
  void shard(const float* piece, int64_t begin, int64_t count, float* local,
             const CopyFloats& copy = copy_host_floats) const;
  // Writes every parameter into `full` (the setup's layout) from `gathered`:
  // every rank's local shard, ranks() x local_numel() elements, rank order.
  void unshard(const float* gathered, float* full, const CopyFloats& copy = copy_host_floats) const;

 private:
  std::vector<meshrun_shard_segment> segments_of(int64_t rank) const;

  int64_t ranks_;
  int64_t rank_;
  std::vector<BlockPlace> blocks_;
  std::vector<UnitSpan> units_;
  int64_t local_numel_ = 0;
};

}  // namespace meshrun::sharding
