// The sharded strategies' shard layout (strategies/sharding/layout.hpp):
// setup takes the shard out of the weights piece by piece as they are
// broadcast, and the pieces, whatever their size, must give the shard the
// segments describe; the chunks an all-gather receives, rank after rank,
// must be the block's full buffer, which the units' views read.
#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "sharding/layout.hpp"

namespace {

using meshrun::sharding::BlockPlace;
using meshrun::sharding::LayoutInput;
using meshrun::sharding::ShardLayout;
using meshrun::sharding::UnitSpan;

constexpr int64_t kRanks = 3;

// 5 parameters in 3 units: sizes 3 ranks do not divide, a scalar, unit 0's
// parameters not contiguous in the setup's layout.
LayoutInput layout_input(bool one_block) {
  LayoutInput input{{0}, {0, 1, 2, 1, 0}, 3, one_block};
  for (const int64_t numel : {7 * 3, 2 * 4, 1, 5 * 2, 4 * 3}) {
    input.offsets.push_back(input.offsets.back() + numel);
  }
  return input;
}

std::vector<float> numbered_weights(const LayoutInput& input) {
  std::vector<float> weights;
  for (int64_t i = 0; i < input.offsets.back(); ++i)
    weights.push_back(static_cast<float>(i) + 0.5f);
  return weights;
}

// Rank `rank`'s local shard, element by element from its segments.
std::vector<float> shard_of(const ShardLayout& layout, const std::vector<float>& weights) {
  std::vector<float> local(static_cast<size_t>(layout.local_numel()), 0.0f);
  for (const meshrun_shard_segment& s : layout.segments()) {
    for (int64_t k = 0; k < s.count; ++k) {
      local[static_cast<size_t>(s.local_begin + k)] =
          weights[static_cast<size_t>(s.global_begin + k)];
    }
  }
  return local;
}

}  // namespace

TEST_CASE("fsdp2 layout: a shard taken in pieces of any size is the segments' shard", "[fsdp2]") {
  const LayoutInput input = layout_input(false);
  const std::vector<float> weights = numbered_weights(input);
  const int64_t numel = input.offsets.back();
  for (int64_t rank = 0; rank < kRanks; ++rank) {
    const ShardLayout layout(input, kRanks, rank);
    const std::vector<float> expected = shard_of(layout, weights);
    for (const int64_t piece : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{13}, numel}) {
      INFO("rank " << rank << ", pieces of " << piece);
      std::vector<float> local(expected.size(), 0.0f);
      for (int64_t begin = 0; begin < numel; begin += piece) {
        // Only the piece is there: copied out, as a receive buffer holds it.
        const std::vector<float> part(weights.begin() + begin,
                                      weights.begin() + std::min(begin + piece, numel));
        layout.shard(part.data(), begin, static_cast<int64_t>(part.size()), local.data());
      }
      CHECK(local == expected);
    }
  }
}

TEST_CASE("fsdp2 layout: the chunks gathered rank after rank are each unit's parameters in order",
          "[fsdp2]") {
  for (const bool one_block : {false, true}) {
    INFO((one_block ? "one block" : "a block per unit"));
    const LayoutInput input = layout_input(one_block);
    const std::vector<float> weights = numbered_weights(input);
    std::vector<std::vector<float>> shards;
    for (int64_t rank = 0; rank < kRanks; ++rank) {
      shards.push_back(shard_of(ShardLayout(input, kRanks, rank), weights));
    }
    const ShardLayout layout(input, kRanks, 0);
    CHECK(layout.num_blocks() == (one_block ? 1 : 3));
    std::vector<float> gathered;  // as an all_gather of every rank's local shard receives it
    for (const std::vector<float>& shard : shards)
      gathered.insert(gathered.end(), shard.begin(), shard.end());
    std::vector<int64_t> held(weights.size(), 0);
    for (int32_t b = 0; b < layout.num_blocks(); ++b) {
      const BlockPlace& block = layout.block(b);
      CHECK(block.chunk == (block.full_numel + kRanks - 1) / kRanks);
      CHECK(block.padded_numel == kRanks * block.chunk);
      std::vector<float> full;  // the receive buffer of the block's all_gather
      for (int64_t r = 0; r < kRanks; ++r) {
        const auto begin = gathered.begin() + r * layout.local_numel() + block.local_begin;
        full.insert(full.end(), begin, begin + block.chunk);
      }
      for (int64_t i = block.full_numel; i < block.padded_numel; ++i)
        CHECK(full[size_t(i)] == 0.0f);
      for (int32_t u = 0; u < layout.num_units(); ++u) {
        const UnitSpan& span = layout.unit(u);
        if (span.block != b) continue;
        std::vector<float> expected;  // the unit's parameters in index order
        for (size_t p = 0; p < input.units.size(); ++p) {
          if (input.units[p] != u) continue;
          expected.insert(expected.end(), weights.begin() + input.offsets[p],
                          weights.begin() + input.offsets[p + 1]);
        }
        CHECK(std::vector<float>(full.begin() + span.begin,
                                 full.begin() + span.begin + span.numel) == expected);
      }
    }
    for (int64_t rank = 0; rank < kRanks; ++rank) {
      for (const meshrun_shard_segment& s : ShardLayout(input, kRanks, rank).segments()) {
        for (int64_t k = 0; k < s.count; ++k) ++held[size_t(s.global_begin + k)];
      }
    }
    CHECK(held == std::vector<int64_t>(weights.size(), 1));  // every element on one rank
    std::vector<float> unsharded(weights.size(), 0.0f);
    layout.unshard(gathered.data(), unsharded.data());
    CHECK(unsharded == weights);
  }
}
