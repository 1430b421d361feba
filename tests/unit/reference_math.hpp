// The plain double-precision pieces the naive Hugging Face references
// (llama_reference.hpp, gpt2_reference.hpp) are written with: one token
// vector at a time, loops only, nothing shared with models/.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/parameters.hpp"

namespace reference {

using Vector = std::vector<double>;
using Weights = std::map<std::string, Vector>;

inline Weights weights_of(const std::vector<meshrun::models::ParameterView>& parameters) {
  Weights weights;
  for (const auto& view : parameters) {
    weights[view.name] = Vector(view.data, view.data + view.numel);
  }
  return weights;
}

inline Vector slice(const Vector& v, int64_t start, int64_t count) {
  return Vector(v.begin() + start, v.begin() + start + count);
}

// W x for W of shape [out, in] (nn.Linear, nn.Embedding as a tied head).
inline Vector matvec(const Vector& w, const Vector& x) {
  const int64_t in = int64_t(x.size()), out = int64_t(w.size()) / in;
  Vector y(out, 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

inline double dot(const Vector& a, const Vector& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += a[i] * b[i];
  return sum;
}

inline Vector softmax(const Vector& z) {
  const double max = *std::max_element(z.begin(), z.end());
  Vector p(z.size());
  double sum = 0;
  for (size_t i = 0; i < z.size(); ++i) sum += p[i] = std::exp(z[i] - max);
  for (double& value : p) value /= sum;
  return p;
}

// Causal attention of position t over positions s <= t for one head: the
// softmax of q_t . k_s * scale, weighting v_s. head(s) gives position s's
// (key, value) of the head.
template <typename KeyValue>
Vector causal_attention(const Vector& query, int64_t t, double scale, KeyValue&& head) {
  Vector scores(t + 1);
  for (int64_t s = 0; s <= t; ++s) scores[s] = dot(query, head(s).first) * scale;
  const Vector probs = softmax(scores);
  Vector out(query.size(), 0.0);
  for (int64_t s = 0; s <= t; ++s) {
    const Vector value = head(s).second;
    for (size_t i = 0; i < out.size(); ++i) out[i] += probs[s] * value[i];
  }
  return out;
}

// The mean natural-log cross-entropy of a causal language model over
// [batch, seq_len]: per sequence, embed(token, position) each token,
// layers(sequence) in place, then logits(hidden) of each position against
// its target.
template <typename Embed, typename Layers, typename Logits>
double causal_lm_loss(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len,
                      Embed&& embed, Layers&& layers, Logits&& logits) {
  double total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Vector> x(seq_len);
    for (int64_t t = 0; t < seq_len; ++t) x[t] = embed(tokens[b * seq_len + t], t);
    layers(x);
    for (int64_t t = 0; t < seq_len; ++t) {
      total -= std::log(softmax(logits(x[t]))[targets[b * seq_len + t]]);
    }
  }
  return total / double(batch * seq_len);
}

}  // namespace reference
