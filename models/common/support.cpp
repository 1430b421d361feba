#include "common/support.hpp"

#include <stdexcept>
#include <string>

namespace meshrun::models {

void check_tokens(const int32_t* tokens, int64_t count, int64_t vocab_size, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      throw std::out_of_range(std::string(what) + "[" + std::to_string(i) +
                              "] = " + std::to_string(tokens[i]) + " is outside [0, vocab_size " +
                              std::to_string(vocab_size) + ")");
    }
  }
}

}  // namespace meshrun::models
