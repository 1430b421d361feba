// A naive Hugging Face GPT-2 forward in double precision, written from the
// definitions in transformers' modeling_gpt2.py (GPT2LMHeadModel) and
// sharing no code with models/: one token vector at a time, plain loops.
// It pins the conventions the optimized model must reproduce: Conv1D's
// [in, out] weights (y = x W + b), c_attn's output split into query, key,
// value and each into heads, the 1/sqrt(head_dim) scale and causal mask,
// nn.LayerNorm's biased variance, gelu_new, positions added to the token
// embeddings, the tied head.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "gpt2/model.hpp"
#include "reference_math.hpp"

namespace gpt2_reference {

using reference::matvec;
using reference::slice;
using reference::Vector;
using reference::Weights;
using reference::weights_of;

// Conv1D: x W + b with W of shape [in, out].
inline Vector conv1d(const Weights& w, const std::string& prefix, const Vector& x) {
  const Vector& weight = w.at(prefix + ".weight");
  Vector y = w.at(prefix + ".bias");
  const int64_t in = int64_t(x.size()), out = int64_t(y.size());
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t o = 0; o < out; ++o) y[o] += x[i] * weight[i * out + o];
  }
  return y;
}

// nn.LayerNorm: (x - mean) / sqrt(var + eps) * weight + bias, var biased.
inline Vector layer_norm(const Weights& w, const std::string& prefix, const Vector& x, double eps) {
  const double n = double(x.size());
  double mean = 0, var = 0;
  for (double value : x) mean += value / n;
  for (double value : x) var += (value - mean) * (value - mean) / n;
  const Vector& weight = w.at(prefix + ".weight");
  const Vector& bias = w.at(prefix + ".bias");
  Vector y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    y[i] = (x[i] - mean) / std::sqrt(var + eps) * weight[i] + bias[i];
  }
  return y;
}

// NewGELUActivation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
inline double gelu_new(double x) {
  return 0.5 * x *
         (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * std::pow(x, 3.0))));
}

// GPT2Attention's output at every position: c_attn's output split into
// query, key, value (n_embd each), each split into n_head heads;
// softmax(q k^T / sqrt(head_dim)) over positions s <= t times v; heads
// merged; c_proj.
inline std::vector<Vector> attention(const std::vector<Vector>& normed,
                                     const meshrun::gpt2::Gpt2Config& config, const Weights& w,
                                     const std::string& prefix) {
  const int64_t seq_len = int64_t(normed.size()), E = config.n_embd;
  const int64_t d = E / config.n_head;
  std::vector<Vector> qkv(seq_len), out(seq_len);
  for (int64_t t = 0; t < seq_len; ++t) qkv[t] = conv1d(w, prefix + "c_attn", normed[t]);
  for (int64_t t = 0; t < seq_len; ++t) {
    Vector merged;
    for (int64_t h = 0; h < config.n_head; ++h) {
      const Vector head = reference::causal_attention(
          slice(qkv[t], h * d, d), t, 1.0 / std::sqrt(double(d)), [&](int64_t s) {
            return std::pair(slice(qkv[s], E + h * d, d), slice(qkv[s], 2 * E + h * d, d));
          });
      merged.insert(merged.end(), head.begin(), head.end());
    }
    out[t] = conv1d(w, prefix + "c_proj", merged);
  }
  return out;
}

// One GPT2Block over a sequence of token vectors, in place:
// x += attn(ln_1(x)); x += mlp(ln_2(x)), mlp = c_proj(gelu_new(c_fc(.))).
inline void block(std::vector<Vector>& x, const meshrun::gpt2::Gpt2Config& config, const Weights& w,
                  const std::string& prefix) {
  const double eps = config.layer_norm_epsilon;
  std::vector<Vector> normed;
  for (const Vector& token : x) normed.push_back(layer_norm(w, prefix + "ln_1", token, eps));
  const std::vector<Vector> attended = attention(normed, config, w, prefix + "attn.");
  for (size_t t = 0; t < x.size(); ++t) {
    for (size_t i = 0; i < x[t].size(); ++i) x[t][i] += attended[t][i];
    Vector hidden = conv1d(w, prefix + "mlp.c_fc", layer_norm(w, prefix + "ln_2", x[t], eps));
    for (double& value : hidden) value = gelu_new(value);
    const Vector projected = conv1d(w, prefix + "mlp.c_proj", hidden);
    for (size_t i = 0; i < x[t].size(); ++i) x[t][i] += projected[i];
  }
}

// Mean natural-log cross-entropy of GPT2LMHeadModel over [batch, seq_len]:
// hidden = wte[token] + wpe[position]; the blocks; ln_f; logits = lm_head
// (wte when tied) times the hidden state.
inline double loss(const meshrun::gpt2::Gpt2Config& config, const Weights& w, const int32_t* tokens,
                   const int32_t* targets, int64_t batch, int64_t seq_len) {
  const int64_t E = config.n_embd;
  const Vector& wte = w.at("transformer.wte.weight");
  const Vector& wpe = w.at("transformer.wpe.weight");
  const Vector& lm_head = config.tie_word_embeddings ? wte : w.at("lm_head.weight");
  return reference::causal_lm_loss(
      tokens, targets, batch, seq_len,
      [&](int32_t token, int64_t position) {
        Vector x = slice(wte, token * E, E);
        for (int64_t i = 0; i < E; ++i) x[i] += wpe[position * E + i];
        return x;
      },
      [&](std::vector<Vector>& x) {
        for (int64_t layer = 0; layer < config.n_layer; ++layer) {
          block(x, config, w, "transformer.h." + std::to_string(layer) + ".");
        }
      },
      [&](const Vector& x) {
        return matvec(lm_head, layer_norm(w, "transformer.ln_f", x, config.layer_norm_epsilon));
      });
}

}  // namespace gpt2_reference
