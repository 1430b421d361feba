#include "layout.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace meshrun::sharding {
namespace {

// Rows per rank: ceil(rows / ranks).
int64_t chunk_rows(int64_t rows, int64_t ranks) { return (rows + ranks - 1) / ranks; }

void copy(const float* from, float* to, int64_t count) {
  std::memcpy(to, from, static_cast<size_t>(count) * sizeof(float));
}

}  // namespace

ShardLayout::ShardLayout(const LayoutInput& input, int64_t ranks, int64_t rank)
    : ranks_(ranks), rank_(rank), units_(static_cast<size_t>(input.num_units)) {
  for (size_t p = 0; p < input.units.size(); ++p) {
    UnitPlace& unit = units_[static_cast<size_t>(input.units[p])];
    ParameterPlace place;
    place.parameter = static_cast<int64_t>(p);
    place.numel = input.offsets[p + 1] - input.offsets[p];
    const int64_t row_numel = input.rows[p] > 0 ? place.numel / input.rows[p] : 0;
    place.chunk = chunk_rows(input.rows[p], ranks) * row_numel;
    place.global_begin = input.offsets[p];
    place.block_begin = unit.block_numel;
    place.unit_begin = unit.full_numel;
    unit.block_numel += place.chunk;
    unit.full_numel += place.numel;
    unit.parameters.push_back(place);
  }
  for (UnitPlace& unit : units_) {
    unit.local_begin = local_numel_;
    local_numel_ += unit.block_numel;
  }
}

std::vector<meshrun_shard_segment> ShardLayout::segments() const {
  std::vector<meshrun_shard_segment> segments;
  for (const UnitPlace& unit : units_) {
    for (const ParameterPlace& place : unit.parameters) {
      if (place.filled(rank_) == 0) continue;
      segments.push_back({place.parameter, place.global_begin + rank_ * place.chunk,
                          unit.local_begin + place.block_begin, place.filled(rank_)});
    }
  }
  return segments;
}

void ShardLayout::shard(const float* piece, int64_t begin, int64_t count, float* local) const {
  const int64_t end = begin + count;
  for (const meshrun_shard_segment& segment : segments()) {
    const int64_t first = std::max(segment.global_begin, begin);
    const int64_t last = std::min(segment.global_begin + segment.count, end);
    if (first >= last) continue;
    copy(piece + (first - begin), local + segment.local_begin + (first - segment.global_begin),
         last - first);
  }
}

void ShardLayout::unshard(const float* gathered, float* full) const {
  for (const UnitPlace& unit : units_) {
    for (const ParameterPlace& place : unit.parameters) {
      for (int64_t r = 0; r < ranks_; ++r) {
        copy(gathered + r * local_numel_ + unit.local_begin + place.block_begin,
             full + place.global_begin + r * place.chunk, place.filled(r));
      }
    }
  }
}

}  // namespace meshrun::sharding
