// A model's parameter tensors as the shipped families describe them, and
// their initialization from a fully specified random stream.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace meshrun::models {

// The units of a decoder-only model of L layers (meshrun/model.h "units"):
// decoder layer l is unit l; then the embedding (token and position
// embeddings), the head (final norm, lm_head) and the root, which holds
// only a tied embedding, used by the embedding and the head both. As
// torchtitan wraps them, no rank gathers the embedding and the head at
// once unless they share their weight.
struct DecoderUnits {
  explicit DecoderUnits(int64_t layers) : embedding(layers), head(layers + 1), root(layers + 2) {}
  int64_t embedding, head, root;
  // The embedding's unit: the root's when tied to the lm_head.
  int64_t token_embedding(bool tied) const { return tied ? root : embedding; }
};

// One parameter tensor: its Hugging Face name and shape, its index among the
// model's parameters and its unit (DecoderUnits), how the family computes
// it over tensor-parallel ranks, and where its values and gradient are
// while a stage computes with it. A stage's views have the shape and numel
// of its tp rank's piece.
struct ParameterView {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t index = 0;
  int64_t unit = 0;
  float* data = nullptr;
  float* grad = nullptr;
  // data's values in bfloat16 when the host holds them (a strategy that
  // gathers in bfloat16), else null; bound with data.
  const uint16_t* bfloat16 = nullptr;
  // "replicate", "shard(d)": the rank's 1/tp of dimension d, or
  // "shard(d,blocks)": of each of `blocks` equal blocks of d (docs/plan.md).
  std::string tp = "replicate";
  // The mixture-of-experts expert it belongs to, or -1: a stage over ep
  // ranks holds the parameters of its own experts only.
  int64_t expert = -1;
};

// Appends the parameter `name` with the next index, without storage. A
// numel past int64_t is kept as INT64_MAX, for require_addressable to refuse.
void add_parameter(std::vector<ParameterView>& views, std::string name, std::vector<int64_t> shape,
                   int64_t unit);

// The most bytes a model's float32 parameters may take: 2^47 (128 TiB) is the
// whole user address space of an x86-64 or AArch64 process, so a larger model
// cannot be held by any machine. Below it every size product of the shipped
// models stays far from int64_t overflow.
inline constexpr int64_t kMaxParameterBytes = int64_t{1} << 47;

// The most layers a shipped model may have. The deepest published
// transformers have a few hundred; each layer adds parameters, a unit and a
// module to the description, which the host plans with, so the bound keeps
// `meshrun plan` within seconds (docs/decisions.md).
inline constexpr int64_t kMaxLayers = 2048;

// A [model] key that sizes the parameters, and its value.
struct SizeKey {
  const char* name;
  int64_t value;
};

// Throws std::invalid_argument("model.<key>: <value> makes the parameters
// take <bytes> bytes as float32, more than ...").
[[noreturn]] void refuse_unaddressable(const char* key, int64_t value, double bytes);

// Throws std::invalid_argument("model.<key>: ...") giving the bytes when
// `parameters` take more than kMaxParameterBytes as float32; the key named is
// the largest of `keys`, the one to lower first.
void require_addressable(const std::vector<ParameterView>& parameters,
                         std::initializer_list<SizeKey> keys);

// Whether views [first, last] lie one after another in the host's storage
// (and their gradients too when `backward`): a fused projection's weights
// may then be used as one matrix (meshrun/model.h).
bool adjacent_views(const ParameterView* first, const ParameterView* last, bool backward);

// Throws std::invalid_argument("model.<key>: ...") unless hidden_size
// divides into num_attention_heads heads and those into groups of
// num_key_value_heads, the Hugging Face names.
void require_attention_heads(int64_t hidden_size, int64_t heads, int64_t kv_heads);

// Fills `values` with parameters[index]'s normal(0, stddev) initial values
// for `seed`. The draws come from one splitmix64 + Box-Muller stream over the
// model's matrices (the parameters of two or more dimensions) in order, each
// element taking two uniform draws, so a seed gives the same weights with any
// standard library and any matrix can be made alone.
void init_normal(const std::vector<ParameterView>& parameters, uint64_t seed, int64_t index,
                 double stddev, float* values);

}  // namespace meshrun::models
