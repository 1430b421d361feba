// A naive Hugging Face Llama forward in double precision, written from the
// definitions in transformers' modeling_llama.py and sharing no code with
// models/llama: one token vector at a time, plain loops, rotate_half spelled
// out. It pins the conventions (rotary halves, GQA head mapping, causal mask,
// RMSNorm) the optimized model must reproduce.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "llama/model.hpp"
#include "reference_math.hpp"

namespace llama_reference {

using reference::dot;
using reference::matvec;
using reference::slice;
using reference::Vector;
using reference::Weights;
using reference::weights_of;

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
      const Vector head =
          reference::causal_attention(query, t, 1.0 / std::sqrt(double(d)), [&](int64_t s) {
            return std::pair(rotary(slice(k[s], kv_head * d, d), s, config.rope_theta),
                             slice(v[s], kv_head * d, d));
          });
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
  return reference::causal_lm_loss(
      tokens, targets, batch, seq_len,
      [&](int32_t token, int64_t) { return slice(embed, token * hidden, hidden); },
      [&](std::vector<Vector>& x) {
        for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
          decoder_layer(x, config, w, "model.layers." + std::to_string(layer) + ".");
        }
      },
      [&](const Vector& x) {
        return matvec(lm_head, rmsnorm(x, w.at("model.norm.weight"), config.rms_norm_eps));
      });
}

}  // namespace llama_reference
