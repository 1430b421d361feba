// Gradient bucket planning for the ddp strategy: a pure function of the
// parameter layout and the caps, kept apart from the plugin so that it can be
// tested without processes or communicators.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace meshrun::ddp {

// PyTorch DDP's defaults: bucket_cap_mb = 25 and a first bucket of 1 MiB, so
// that the first all-reduce starts early in backward.
inline constexpr double kDefaultBucketCapMb = 25.0;
inline constexpr int64_t kFirstBucketBytes = int64_t{1} << 20;

// Parameters [first_parameter, end_parameter) occupying elements
// [begin, end) of the flat buffers. Buckets are contiguous because the
// parameters are.
struct Bucket {
  int64_t first_parameter = 0;
  int64_t end_parameter = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// Buckets over the parameters `offsets` describes (num_parameters + 1
// element offsets, non-decreasing), in reverse parameter order: bucket 0
// holds the last parameters, the ones backward finishes first. Bucket 0 holds
// at most min(first_bucket_bytes, cap_bytes), every other at most cap_bytes,
// except that a parameter larger than its cap gets a bucket of its own.
// Unlike PyTorch, which closes a bucket only once it has reached the cap (so
// one tensor may overshoot it), a bucket is closed before a parameter would
// push it past the cap: the cap is a bound the user can rely on.
inline std::vector<Bucket> plan_buckets(const std::vector<int64_t>& offsets, int64_t element_bytes,
                                        int64_t cap_bytes,
                                        int64_t first_bucket_bytes = kFirstBucketBytes) {
  if (offsets.empty()) throw std::invalid_argument("parameter offsets are empty");
  if (element_bytes <= 0 || cap_bytes <= 0 || first_bucket_bytes <= 0) {
    throw std::invalid_argument("bucket caps and element size must be positive");
  }
  std::vector<Bucket> buckets;
  const auto num_parameters = static_cast<int64_t>(offsets.size()) - 1;
  Bucket current{num_parameters, num_parameters, offsets.back(), offsets.back()};
  int64_t cap = std::min(first_bucket_bytes, cap_bytes);
  for (int64_t p = num_parameters - 1; p >= 0; --p) {
    const int64_t begin = offsets[static_cast<size_t>(p)];
    const int64_t end = offsets[static_cast<size_t>(p) + 1];
    if (end < begin) throw std::invalid_argument("parameter offsets decrease");
    const bool has_parameters = current.first_parameter < current.end_parameter;
    if (has_parameters && (current.end - begin) * element_bytes > cap) {
      buckets.push_back(current);
      current = Bucket{p + 1, p + 1, end, end};
      cap = cap_bytes;
    }
    current.first_parameter = p;
    current.begin = begin;
  }
  if (current.first_parameter < current.end_parameter) buckets.push_back(current);
  return buckets;
}

}  // namespace meshrun::ddp
