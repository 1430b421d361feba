// The ddp strategy's bucket plan (strategies/ddp/buckets.hpp): reverse
// parameter order, a small first bucket, caps respected at parameter
// boundaries, every parameter in exactly one bucket.
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "buckets.hpp"

namespace {

using meshrun::ddp::Bucket;
using meshrun::ddp::plan_buckets;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kFloat = 4;

// Offsets of parameters of the given element counts, laid out in order.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& numels) {
  std::vector<int64_t> offsets{0};
  for (int64_t numel : numels) offsets.push_back(offsets.back() + numel);
  return offsets;
}

// Buckets tile the parameters backwards: bucket 0 ends at the last
// parameter, each next one ends where the previous began, down to 0.
void check_tiling(const std::vector<Bucket>& buckets, const std::vector<int64_t>& offsets) {
  const auto num_parameters = static_cast<int64_t>(offsets.size()) - 1;
  REQUIRE(!buckets.empty());
  int64_t next_end = num_parameters;
  for (const Bucket& bucket : buckets) {
    CHECK(bucket.end_parameter == next_end);
    CHECK(bucket.first_parameter < bucket.end_parameter);
    CHECK(bucket.begin == offsets[static_cast<size_t>(bucket.first_parameter)]);
    CHECK(bucket.end == offsets[static_cast<size_t>(bucket.end_parameter)]);
    next_end = bucket.first_parameter;
  }
  CHECK(next_end == 0);
}

}  // namespace

TEST_CASE("ddp buckets: reverse order, first bucket 1 MiB, then the cap", "[ddp]") {
  // 40 parameters of 256 KiB (64 Ki floats): 4 fit in 1 MiB, 8 in 2 MiB.
  const auto offsets = offsets_of(std::vector<int64_t>(40, 64 * 1024));
  const auto buckets = plan_buckets(offsets, kFloat, 2 * kMiB);
  check_tiling(buckets, offsets);
  REQUIRE(buckets.size() == 1 + 36 / 8 + 1);
  CHECK(buckets[0].first_parameter == 36);  // the last four parameters
  CHECK((buckets[0].end - buckets[0].begin) * kFloat == kMiB);
  for (size_t b = 1; b + 1 < buckets.size(); ++b) {
    CHECK((buckets[b].end - buckets[b].begin) * kFloat == 2 * kMiB);
  }
  CHECK(buckets.back().first_parameter == 0);
  CHECK(buckets.back().end_parameter == 4);
}

TEST_CASE("ddp buckets: no bucket exceeds its cap unless one parameter does", "[ddp]") {
  // Mixed sizes, with one parameter (index 3) larger than the cap.
  const std::vector<int64_t> numels = {1000, 70000, 30000, 400000, 5, 120000, 90000, 60000, 1};
  const auto offsets = offsets_of(numels);
  const int64_t cap = kMiB / 2;
  const auto buckets = plan_buckets(offsets, kFloat, cap);
  check_tiling(buckets, offsets);
  for (const Bucket& bucket : buckets) {
    const int64_t bytes = (bucket.end - bucket.begin) * kFloat;
    if (bucket.end_parameter - bucket.first_parameter > 1) CHECK(bytes <= cap);
  }
  // The oversized parameter has a bucket of its own.
  bool alone = false;
  for (const Bucket& bucket : buckets) {
    alone = alone || (bucket.first_parameter == 3 && bucket.end_parameter == 4);
  }
  CHECK(alone);
  // Greedy: a bucket closes only because the next parameter would not fit
  // (the first bucket's 1 MiB is above this cap, so the cap bounds it too).
  for (size_t b = 0; b + 1 < buckets.size(); ++b) {
    const auto next = static_cast<size_t>(buckets[b].first_parameter) - 1;
    CHECK((buckets[b].end - offsets[next]) * kFloat > cap);
  }
}

TEST_CASE("ddp buckets: a cap below 1 MiB also bounds the first bucket", "[ddp]") {
  const auto offsets = offsets_of(std::vector<int64_t>(10, 32 * 1024));  // 128 KiB each
  const auto buckets = plan_buckets(offsets, kFloat, kMiB / 4);
  check_tiling(buckets, offsets);
  REQUIRE(buckets.size() == 5);
  for (const Bucket& bucket : buckets) CHECK(bucket.end_parameter - bucket.first_parameter == 2);
}

TEST_CASE("ddp buckets: the default cap puts a small model in two buckets", "[ddp]") {
  // 3 MiB of parameters: 1 MiB first, the remaining 2 MiB under 25 MiB.
  const auto offsets = offsets_of(std::vector<int64_t>(12, 64 * 1024));
  const auto buckets =
      plan_buckets(offsets, kFloat, static_cast<int64_t>(meshrun::ddp::kDefaultBucketCapMb * kMiB));
  check_tiling(buckets, offsets);
  REQUIRE(buckets.size() == 2);
  CHECK(buckets[0].first_parameter == 8);
}

TEST_CASE("ddp buckets: empty parameters and a single parameter", "[ddp]") {
  const auto one = offsets_of({10});
  const auto single = plan_buckets(one, kFloat, kMiB);
  REQUIRE(single.size() == 1);
  CHECK(single[0].first_parameter == 0);
  CHECK(single[0].end == 10);
  const auto with_empty = offsets_of({4, 0, 4});
  check_tiling(plan_buckets(with_empty, kFloat, 16), with_empty);
  CHECK(plan_buckets({0}, kFloat, kMiB).empty());
}

TEST_CASE("ddp buckets: bad layouts are refused", "[ddp]") {
  CHECK_THROWS(plan_buckets({}, kFloat, kMiB));
  CHECK_THROWS(plan_buckets({0, 8, 4}, kFloat, kMiB));
  CHECK_THROWS(plan_buckets({0, 8}, kFloat, 0));
}
