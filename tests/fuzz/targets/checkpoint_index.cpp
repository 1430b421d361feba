// Fuzz target: a sharded checkpoint's index.json (checkpoint.resume_from),
// read for the parameters of a small model.
#include "fuzz_input.hpp"
#include "state/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const meshrun::CheckpointLayout layout = meshrun::checkpoint_layout(
      "llama", {"model.embed_tokens.weight", "model.norm.weight"}, {{256, 8}, {8}});
  meshrun::fuzz::write_input("index.json", data, size);
  meshrun::fuzz::refuse_or_accept(
      [&] { meshrun::read_index(meshrun::fuzz::scratch_dir().string(), layout); });
  return 0;
}
