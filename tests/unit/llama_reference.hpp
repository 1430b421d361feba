// A naive Hugging Face Llama forward in double precision, written from the
// definitions in transformers' modeling_llama.py and sharing no code with
// models/llama: one token vector at a time, plain loops, rotate_half spelled
// out. It pins the conventions (rotary halves, GQA head mapping, causal mask,
// RMSNorm) the optimized model must reproduce.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "llama/model.hpp"

namespace llama_reference {

using Vector = std::vector<double>;
using Weights = std::map<std::string, Vector>;

inline Weights weights_of(const std::vector<meshrun::llama::ParameterView>& parameters) {
  Weights weights;
  for (const auto& view : parameters) {
    weights[view.name] = Vector(view.data, view.data + view.numel);
  }
  return weights;
}

inline Vector slice(const Vector& v, int64_t start, int64_t count) {
  return Vector(v.begin() + start, v.begin() + start + count);
}

// W x for W of shape [out, in].
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

// LlamaRMSNorm: weight * (x / sqrt(mean(x^2) + eps)).
inline Vector rmsnorm(const Vector& x, const Vector& weight, double eps) {
  const double mean_square = dot(x, x) / double(x.size());
  Vector y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = weight[i] * (x[i] / std::sqrt(mean_square + eps));
  return y;
}

// rotate_half(x) = cat(-x[d/2:], x[:d/2]).
inline Vector rotate_half(const Vector& x) {
  const size_t half = x.size() / 2;
  Vector y(x.size());
  for (size_t i = 0; i < half; ++i) {
    y[i] = -x[half + i];
    y[half + i] = x[i];
  }
  return y;
}

// apply_rotary_pos_emb for one head vector at position pos:
// inv_freq = 1 / theta^(arange(0, d, 2) / d), emb = cat(freqs, freqs),
// x * cos(emb) + rotate_half(x) * sin(emb).
inline Vector rotary(const Vector& x, int64_t pos, double theta) {
  const size_t d = x.size();
  Vector emb(d);
  for (size_t i = 0; i < d / 2; ++i) {
    const double inv_freq = 1.0 / std::pow(theta, double(2 * i) / double(d));
    emb[i] = emb[d / 2 + i] = double(pos) * inv_freq;
  }
  const Vector rotated = rotate_half(x);
  Vector y(d);
  for (size_t i = 0; i < d; ++i) y[i] = x[i] * std::cos(emb[i]) + rotated[i] * std::sin(emb[i]);
  return y;
}

inline Vector softmax(const Vector& z) {
  const double max = *std::max_element(z.begin(), z.end());
  Vector p(z.size());
  double sum = 0;
  for (size_t i = 0; i < z.size(); ++i) sum += p[i] = std::exp(z[i] - max);
  for (double& value : p) value /= sum;
  return p;
}

// One LlamaDecoderLayer over a sequence of token vectors, in place.
inline void decoder_layer(std::vector<Vector>& x, const meshrun::llama::LlamaConfig& config,
                          const Weights& w, const std::string& prefix) {
  const int64_t seq_len = int64_t(x.size());
  const int64_t d = config.hidden_size / config.num_attention_heads;
  const int64_t group = config.num_attention_heads / config.num_key_value_heads;
  std::vector<Vector> q(seq_len), k(seq_len), v(seq_len);
  for (int64_t t = 0; t < seq_len; ++t) {
    const Vector normed =
        rmsnorm(x[t], w.at(prefix + "input_layernorm.weight"), config.rms_norm_eps);
    q[t] = matvec(w.at(prefix + "self_attn.q_proj.weight"), normed);
    k[t] = matvec(w.at(prefix + "self_attn.k_proj.weight"), normed);
    v[t] = matvec(w.at(prefix + "self_attn.v_proj.weight"), normed);
  }
  for (int64_t t = 0; t < seq_len; ++t) {
    Vector attention;
    for (int64_t h = 0; h < config.num_attention_heads; ++h) {
      const int64_t kv_head = h / group;  // repeat_kv
      const Vector query = rotary(slice(q[t], h * d, d), t, config.rope_theta);
      Vector scores(t + 1);  // causal: keys at positions s <= t only
      for (int64_t s = 0; s <= t; ++s) {
        const Vector key = rotary(slice(k[s], kv_head * d, d), s, config.rope_theta);
        scores[s] = dot(query, key) / std::sqrt(double(d));
      }
      const Vector probs = softmax(scores);
      Vector head(d, 0.0);
      for (int64_t s = 0; s <= t; ++s) {
        for (int64_t i = 0; i < d; ++i) head[i] += probs[s] * v[s][kv_head * d + i];
      }
      attention.insert(attention.end(), head.begin(), head.end());
    }
    const Vector projected = matvec(w.at(prefix + "self_attn.o_proj.weight"), attention);
    for (int64_t i = 0; i < config.hidden_size; ++i) x[t][i] += projected[i];
  }
  for (int64_t t = 0; t < seq_len; ++t) {
    const Vector normed =
        rmsnorm(x[t], w.at(prefix + "post_attention_layernorm.weight"), config.rms_norm_eps);
    const Vector gate = matvec(w.at(prefix + "mlp.gate_proj.weight"), normed);
    const Vector up = matvec(w.at(prefix + "mlp.up_proj.weight"), normed);
    Vector activated(gate.size());
    for (size_t i = 0; i < gate.size(); ++i) {
      activated[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];  // silu(gate) * up
    }
    const Vector down = matvec(w.at(prefix + "mlp.down_proj.weight"), activated);
    for (int64_t i = 0; i < config.hidden_size; ++i) x[t][i] += down[i];
  }
}

// Mean natural-log cross-entropy of LlamaForCausalLM over [batch, seq_len].
inline double loss(const meshrun::llama::LlamaConfig& config, const Weights& w,
                   const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len) {
  const int64_t hidden = config.hidden_size;
  const Vector& embed = w.at("model.embed_tokens.weight");
  const Vector& lm_head = config.tie_word_embeddings ? embed : w.at("lm_head.weight");
  double total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Vector> x(seq_len);
    for (int64_t t = 0; t < seq_len; ++t) {
      x[t] = slice(embed, tokens[b * seq_len + t] * hidden, hidden);
    }
    for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
      decoder_layer(x, config, w, "model.layers." + std::to_string(layer) + ".");
    }
    for (int64_t t = 0; t < seq_len; ++t) {
      const Vector logits =
          matvec(lm_head, rmsnorm(x[t], w.at("model.norm.weight"), config.rms_norm_eps));
      const Vector probs = softmax(logits);
      total -= std::log(probs[targets[b * seq_len + t]]);
    }
  }
  return total / double(batch * seq_len);
}

}  // namespace llama_reference
