#include "common/parameters.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>
#include <utility>

namespace meshrun::models {

namespace {

// splitmix64 (Steele, Lea, Flood 2014): fully specified, unlike the
// distributions of <random>, so a seed means the same weights everywhere.
// Its state advances by a constant per draw, so `skip` jumps ahead at once.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  void skip(uint64_t draws) { state_ += draws * kGamma; }
  uint64_t next() {
    uint64_t z = (state_ += kGamma);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1]: the top 53 bits, shifted off zero so log() is finite.
  double uniform() { return (double(next() >> 11) + 1.0) * 0x1.0p-53; }

 private:
  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ull;
  uint64_t state_;
};

// Box-Muller: sqrt(-2 ln u1) cos(2 pi u2) is standard normal.
double standard_normal(SplitMix64& generator) {
  const double radius = std::sqrt(-2.0 * std::log(generator.uniform()));
  return radius * std::cos(2.0 * std::numbers::pi * generator.uniform());
}

bool is_matrix(const ParameterView& view) { return view.shape.size() > 1; }

}  // namespace

void add_parameter(std::vector<ParameterView>& views, std::string name, std::vector<int64_t> shape,
                   int64_t unit) {
  int64_t numel = 1;
  for (int64_t size : shape) {
    if (__builtin_mul_overflow(numel, size, &numel)) numel = std::numeric_limits<int64_t>::max();
  }
  const auto index = int64_t(views.size());
  views.push_back({std::move(name), std::move(shape), numel, index, unit, nullptr, nullptr});
}

void require_addressable(const std::vector<ParameterView>& parameters,
                         std::initializer_list<SizeKey> keys) {
  constexpr int64_t kFloatBytes = 4;
  constexpr int64_t kMaxElements = kMaxParameterBytes / kFloatBytes;
  int64_t elements = 0;
  for (const ParameterView& view : parameters) {
    // Cannot overflow: the sum stops growing once past the bound.
    elements += std::min(view.numel, kMaxElements + 1);
    if (elements > kMaxElements) break;
  }
  if (elements <= kMaxElements) return;
  const SizeKey largest = *std::max_element(keys.begin(), keys.end(),
                                            [](SizeKey a, SizeKey b) { return a.value < b.value; });
  // The bytes in floating point: the exact count may be past int64_t.
  double bytes = 0;
  for (const ParameterView& view : parameters) {
    double numel = kFloatBytes;
    for (const int64_t extent : view.shape) numel *= double(extent);
    bytes += numel;
  }
  refuse_unaddressable(largest.name, largest.value, bytes);
}

void refuse_unaddressable(const char* key, int64_t value, double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", bytes);
  throw std::invalid_argument("model." + std::string(key) + ": " + std::to_string(value) +
                              " makes the parameters take " + text +
                              " bytes as float32, more than the 2^47 bytes (128 TiB) any "
                              "machine can address");
}

void init_normal(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                 double stddev, float* values) {
  uint64_t draws = 0;
  for (int64_t p = 0; p < index; ++p) {
    if (is_matrix(parameters[size_t(p)])) draws += 2 * uint64_t(parameters[size_t(p)].numel);
  }
  SplitMix64 generator(seed);
  generator.skip(draws);
  const ParameterView& view = parameters.at(size_t(index));
  for (int64_t i = 0; i < view.numel; ++i) {
    values[i] = float(stddev * standard_normal(generator));
  }
}

bool adjacent_views(const ParameterView* first, const ParameterView* last, bool backward) {
  for (const ParameterView* view = first; view < last; ++view) {
    if (view->data + view->numel != view[1].data ||
        (backward && view->grad + view->numel != view[1].grad)) {
      return false;
    }
  }
  return true;
}

void require_attention_heads(int64_t hidden_size, int64_t heads, int64_t kv_heads) {
  if (hidden_size % heads != 0) {
    throw std::invalid_argument("model.hidden_size: " + std::to_string(hidden_size) +
                                " must be divisible by model.num_attention_heads (" +
                                std::to_string(heads) + ")");
  }
  if (heads % kv_heads != 0) {
    throw std::invalid_argument("model.num_key_value_heads: model.num_attention_heads (" +
                                std::to_string(heads) + ") must be divisible by it (" +
                                std::to_string(kv_heads) + ")");
  }
}

}  // namespace meshrun::models
