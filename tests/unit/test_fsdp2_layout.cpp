// The fsdp2 strategy's shard layout (strategies/sharding/layout.hpp): setup
// takes the shard out of the weights piece by piece as they are broadcast,
// and the pieces, whatever their size, must give the shard the segments
// describe.
#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

#include "sharding/layout.hpp"

namespace {

using meshrun::sharding::LayoutInput;
using meshrun::sharding::ShardLayout;

// 5 parameters in 3 units, with row counts 3 ranks do not divide, one with
// fewer rows than ranks, and unit 0's parameters not contiguous.
LayoutInput layout_input() {
  LayoutInput input{{0}, {7, 2, 1, 5, 4}, {0, 1, 2, 1, 0}, 3};
  for (const int64_t numel : {7 * 3, 2 * 4, 1, 5 * 2, 4 * 3}) {
    input.offsets.push_back(input.offsets.back() + numel);
  }
  return input;
}

}  // namespace

TEST_CASE("fsdp2 layout: a shard taken in pieces of any size is the segments' shard", "[fsdp2]") {
  const LayoutInput input = layout_input();
  const int64_t numel = input.offsets.back();
  std::vector<float> weights;
  for (int64_t i = 0; i < numel; ++i) weights.push_back(static_cast<float>(i) + 0.5f);
  constexpr int64_t kRanks = 3;
  for (int64_t rank = 0; rank < kRanks; ++rank) {
    const ShardLayout layout(input, kRanks, rank);
    const auto local_numel = static_cast<size_t>(layout.local_numel());
    std::vector<float> expected(local_numel, 0.0f);
    for (const meshrun_shard_segment& s : layout.segments()) {
      for (int64_t k = 0; k < s.count; ++k) {
        expected[static_cast<size_t>(s.local_begin + k)] =
            weights[static_cast<size_t>(s.global_begin + k)];
      }
    }
    for (const int64_t piece : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{13}, numel}) {
      INFO("rank " << rank << ", pieces of " << piece);
      std::vector<float> local(local_numel, 0.0f);
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
