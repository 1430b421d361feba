// Fuzz target: the safetensors reader (model.checkpoint, sharded
// checkpoints): the header, then every tensor read back whole.
#include <vector>

#include "fuzz_input.hpp"
#include "state/safetensors.hpp"

namespace {

// Tensors are read whole only up to this many elements, so that a header
// that passes with a large shape does not make the target slow.
constexpr int64_t kMaxReadElements = int64_t{1} << 20;

void read_all(const std::string& path) {
  const meshrun::SafetensorsFile file(path);
  for (const auto& [name, tensor] : file.tensors()) {
    int64_t numel = 1;
    for (const int64_t extent : tensor.shape) {
      if (extent < 0 || __builtin_mul_overflow(numel, extent, &numel)) return;
    }
    if (numel > kMaxReadElements) continue;
    std::vector<float> values(static_cast<size_t>(numel));
    file.read(name, 0, numel, values.data());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = meshrun::fuzz::write_input("model.safetensors", data, size);
  meshrun::fuzz::refuse_or_accept([&] { read_all(path); });
  return 0;
}
