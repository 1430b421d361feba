#include "layout.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace meshrun::sharding {

ShardLayout::ShardLayout(const LayoutInput& input, int64_t ranks, int64_t rank)
    : ranks_(ranks),
      rank_(rank),
      blocks_(input.one_block ? 1 : static_cast<size_t>(input.num_units)),
      units_(static_cast<size_t>(input.num_units)) {
  std::vector<std::vector<int64_t>> unit_parameters(static_cast<size_t>(input.num_units));
  for (size_t p = 0; p < input.units.size(); ++p) {
    unit_parameters[static_cast<size_t>(input.units[p])].push_back(static_cast<int64_t>(p));
  }
  for (int32_t u = 0; u < input.num_units; ++u) {
    UnitSpan& span = units_[static_cast<size_t>(u)];
    span.block = input.one_block ? 0 : u;
    BlockPlace& block = blocks_[static_cast<size_t>(span.block)];
    span.begin = block.full_numel;
    for (const int64_t p : unit_parameters[static_cast<size_t>(u)]) {
      const int64_t numel = input.offsets[size_t(p) + 1] - input.offsets[size_t(p)];
      block.parameters.push_back({p, numel, input.offsets[size_t(p)], block.full_numel});
      block.full_numel += numel;
    }
    span.numel = block.full_numel - span.begin;
  }
  for (BlockPlace& block : blocks_) {
    block.chunk = (block.full_numel + ranks - 1) / ranks;
    block.padded_numel = ranks * block.chunk;
    block.local_begin = local_numel_;
    local_numel_ += block.chunk;
  }
}

// Rank `rank` holds elements [rank c, (rank + 1) c) of each block's full
// buffer: the parts of the parameters that overlap them.
std::vector<meshrun_shard_segment> ShardLayout::segments_of(int64_t rank) const {
  std::vector<meshrun_shard_segment> segments;
  for (const BlockPlace& block : blocks_) {
    const int64_t first = rank * block.chunk;
    const int64_t last = first + block.chunk;
    for (const ParameterPlace& place : block.parameters) {
      const int64_t begin = std::max(first, place.block_begin);
      const int64_t end = std::min(last, place.block_begin + place.numel);
      if (begin >= end) continue;
      segments.push_back({place.parameter, place.global_begin + (begin - place.block_begin),
                          block.local_begin + (begin - first), end - begin});
    }
  }
  return segments;
}

void copy_host_floats(float* to, const float* from, int64_t count) {
  std::memcpy(to, from, static_cast<size_t>(count) * sizeof(float));
}

void ShardLayout::shard(const float* piece, int64_t begin, int64_t count, float* local,
                        const CopyFloats& copy) const {
  const int64_t end = begin + count;
  for (const meshrun_shard_segment& segment : segments()) {
    const int64_t first = std::max(segment.global_begin, begin);
    const int64_t last = std::min(segment.global_begin + segment.count, end);
    if (first >= last) continue;
    copy(local + segment.local_begin + (first - segment.global_begin), piece + (first - begin),
         last - first);
  }
}

void ShardLayout::unshard(const float* gathered, float* full, const CopyFloats& copy) const {
  for (int64_t r = 0; r < ranks_; ++r) {
    for (const meshrun_shard_segment& segment : segments_of(r)) {
      copy(full + segment.global_begin, gathered + r * local_numel_ + segment.local_begin,
           segment.count);
    }
  }
}

}  // namespace meshrun::sharding
