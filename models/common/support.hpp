// Small pieces every shipped model needs around its kernels.
#pragma once

#include <cstdint>

namespace meshrun::models {

// Throws std::out_of_range naming `what` for an id outside [0, vocab_size).
void check_tokens(const int32_t* tokens, int64_t count, int64_t vocab_size, const char* what);

// The bytes the vectors hold.
template <typename... Vectors>
int64_t bytes_of(const Vectors&... vectors) {
  return int64_t(((vectors.capacity() * sizeof(typename Vectors::value_type)) + ...));
}

}  // namespace meshrun::models
