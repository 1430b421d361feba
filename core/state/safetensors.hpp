// The safetensors format (huggingface/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}} plus
// "__metadata__", then the tensors' raw little-endian bytes. Written and read
// here directly: the format is small and a library for it is not packaged.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "state/durable_io.hpp"

namespace meshrun {

// A float32 tensor to write, stored as "F32" or rounded to "BF16".
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
  int64_t numel = 0;
};

// Writes `tensors` in order; `bfloat16` stores them as BF16; `metadata` joins
// "__metadata__". Written through write_atomically: a reader never sees half
// a file, and a failed write throws naming the file and the bytes missing.
WrittenFile write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              bool bfloat16,
                              const std::map<std::string, std::string>& metadata = {});

// A tensor of a file read by SafetensorsFile.
struct StoredTensor {
  std::string dtype;  // "F32" or "BF16" (others are refused on reading)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t begin = 0;  // byte offsets in the data section
  int64_t end = 0;
};

// A safetensors file: the header at once, tensor data on demand.
class SafetensorsFile {
 public:
  // Throws meshrun::Error (INVALID_ARGUMENT) naming the file when it is
  // missing or malformed: a header that is not JSON or longer than the file,
  // an unknown dtype, a negative extent, data_offsets whose byte range is not
  // numel x the dtype's size, or byte ranges that do not tile the data
  // section exactly (in order of begin, no gap, no overlap), as the format's
  // reference reader requires.
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const std::map<std::string, StoredTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Elements [first, first + count) of tensor `name` as float32; throws
  // naming the file for a tensor it does not hold or elements beyond it.
  void read(const std::string& name, int64_t first, int64_t count, float* out) const;

 private:
  std::string path_;
  int64_t data_start_ = 0;
  std::map<std::string, StoredTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace meshrun
