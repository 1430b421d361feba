#include "state/safetensors.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "errors.hpp"
#include "meshrun/dtype.hpp"

namespace meshrun {
namespace {

// The reference implementation refuses larger headers; so does this reader,
// before allocating one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

int64_t element_bytes(const std::string& dtype) { return dtype == "BF16" ? 2 : 4; }

std::string header_json(const std::vector<TensorToWrite>& tensors, const std::string& dtype,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  int64_t offset = 0;
  for (const auto& tensor : tensors) {
    const int64_t bytes = tensor.numel * element_bytes(dtype);
    header[tensor.name] = {
        {"dtype", dtype}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  for (const auto& [key, value] : metadata) header["__metadata__"][key] = value;
  std::string text = header.dump();
  // Pads with spaces (the format allows them) so the data starts 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_tensor(OutputFile& out, const TensorToWrite& tensor, bool bfloat16, int64_t file_bytes) {
  if (!bfloat16) {
    out.write(tensor.data, size_t(tensor.numel) * 4, file_bytes);
    return;
  }
  std::vector<uint16_t> bits(tensor.numel);
  for (int64_t i = 0; i < tensor.numel; ++i) bits[i] = float_to_bfloat16(tensor.data[i]);
  out.write(bits.data(), size_t(tensor.numel) * 2, file_bytes);
}

Error file_error(const std::string& path, const std::string& what) {
  return invalid_argument(fmt::format("{}: {}", path, what));
}

// The product of `shape`, or -1 when an extent is negative or it overflows.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (const int64_t extent : shape) {
    if (extent < 0 || __builtin_mul_overflow(numel, extent, &numel)) return -1;
  }
  return numel;
}

StoredTensor parse_entry(const std::string& path, const std::string& name,
                         const nlohmann::json& entry) {
  const auto fail = [&](const std::string& what) {
    return file_error(path, fmt::format("tensor '{}' {}", name, what));
  };
  StoredTensor tensor;
  tensor.dtype = entry.at("dtype").get<std::string>();
  if (tensor.dtype != "F32" && tensor.dtype != "BF16") {
    throw fail(fmt::format("has dtype {}; F32 and BF16 are read", tensor.dtype));
  }
  tensor.shape = entry.at("shape").get<std::vector<int64_t>>();
  tensor.numel = checked_numel(tensor.shape);
  if (tensor.numel < 0) {
    throw fail(
        fmt::format("has shape {}: extents must be non-negative and their product fit "
                    "in 64 bits",
                    entry.at("shape").dump()));
  }
  const auto offsets = entry.at("data_offsets").get<std::vector<int64_t>>();
  if (offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0]) {
    throw fail(fmt::format("has data_offsets {}; valid: [begin, end] with 0 <= begin <= end",
                           entry.at("data_offsets").dump()));
  }
  tensor.begin = offsets[0];
  tensor.end = offsets[1];
  int64_t bytes = 0;
  if (__builtin_mul_overflow(tensor.numel, element_bytes(tensor.dtype), &bytes) ||
      tensor.end - tensor.begin != bytes) {
    throw fail(
        fmt::format("has data_offsets [{}, {}] ({} bytes); its shape {} in {} needs {} "
                    "elements x {} bytes",
                    tensor.begin, tensor.end, tensor.end - tensor.begin, entry.at("shape").dump(),
                    tensor.dtype, tensor.numel, element_bytes(tensor.dtype)));
  }
  return tensor;
}

std::map<std::string, std::string> parse_metadata(const std::string& path,
                                                  const nlohmann::json& metadata) {
  std::map<std::string, std::string> values;
  for (const auto& [key, value] : metadata.items()) {
    if (!value.is_string()) {
      throw file_error(path, fmt::format("__metadata__ '{}' is {}; the format's metadata values "
                                         "are strings",
                                         key, value.dump()));
    }
    values[key] = value.get<std::string>();
  }
  return values;
}

// The tensors' byte ranges must tile [0, data_bytes): each begins where the
// previous one (in order of begin) ends, so none overlaps another, none lies
// beyond the data, and no byte is unaccounted for.
void check_data_tiling(const std::string& path, const std::map<std::string, StoredTensor>& tensors,
                       int64_t data_bytes) {
  std::vector<std::pair<int64_t, std::string>> by_begin;
  for (const auto& [name, tensor] : tensors) by_begin.emplace_back(tensor.begin, name);
  std::sort(by_begin.begin(), by_begin.end());
  int64_t expected = 0;
  std::string previous = "the start of the data";
  for (const auto& [begin, name] : by_begin) {
    if (begin != expected) {
      throw file_error(path, fmt::format("tensor '{}' begins at data byte {}, but {} ends at {}: "
                                         "tensors must follow each other without gap or overlap",
                                         name, begin, previous, expected));
    }
    expected = tensors.at(name).end;
    previous = fmt::format("tensor '{}'", name);
  }
  if (expected != data_bytes) {
    throw file_error(path, fmt::format("the tensors' data end at byte {}, the file's data section "
                                       "holds {} bytes",
                                       expected, data_bytes));
  }
}

}  // namespace

WrittenFile write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              bool bfloat16, const std::map<std::string, std::string>& metadata) {
  const std::string dtype = bfloat16 ? "BF16" : "F32";
  const std::string header = header_json(tensors, dtype, metadata);
  int64_t file_bytes = 8 + int64_t(header.size());
  for (const auto& tensor : tensors) file_bytes += tensor.numel * element_bytes(dtype);
  return write_atomically(path, [&](OutputFile& out) {
    unsigned char length[8] = {};
    for (int byte = 0; byte < 8; ++byte)
      length[byte] = (uint64_t(header.size()) >> (8 * byte)) & 0xff;
    out.write(length, 8, file_bytes);
    out.write(header.data(), header.size(), file_bytes);
    for (const auto& tensor : tensors) write_tensor(out, tensor, bfloat16, file_bytes);
  });
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_, std::ios::binary);
  if (!in) throw file_error(path_, "cannot be read");
  unsigned char length_bytes[8] = {};
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t length = 0;
  for (int byte = 7; byte >= 0; --byte) length = (length << 8) | length_bytes[byte];
  std::error_code size_error;
  const auto file_size = std::filesystem::file_size(path_, size_error);
  if (!in || size_error || length > file_size - 8 || length > kMaxHeaderBytes) {
    throw file_error(path_, fmt::format("not a safetensors file (its first 8 bytes give a header "
                                        "of {} bytes; the file has {})",
                                        length, file_size));
  }
  std::string header(length, '\0');
  in.read(header.data(), std::streamsize(length));
  data_start_ = int64_t(8 + length);
  try {
    const nlohmann::json parsed = nlohmann::json::parse(header);
    if (!parsed.is_object()) throw file_error(path_, "the safetensors header is not a JSON object");
    for (const auto& [name, entry] : parsed.items()) {
      if (name == "__metadata__") {
        metadata_ = parse_metadata(path_, entry);
      } else {
        tensors_[name] = parse_entry(path_, name, entry);
      }
    }
  } catch (const nlohmann::json::exception& error) {
    throw file_error(path_, std::string("bad safetensors header: ") + error.what());
  }
  check_data_tiling(path_, tensors_, int64_t(file_size) - data_start_);
}

void SafetensorsFile::read(const std::string& name, int64_t first, int64_t count,
                           float* out) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) throw file_error(path_, fmt::format("holds no tensor '{}'", name));
  const StoredTensor& tensor = found->second;
  if (first < 0 || count < 0 || first + count > tensor.numel) {
    throw file_error(path_, fmt::format("tensor '{}' has {} elements; elements [{}, {}) were asked",
                                        name, tensor.numel, first, first + count));
  }
  const int64_t width = element_bytes(tensor.dtype);
  std::ifstream in(path_, std::ios::binary);
  in.seekg(data_start_ + tensor.begin + first * width);
  std::vector<char> raw(count * width);
  in.read(raw.data(), std::streamsize(raw.size()));
  if (!in) throw file_error(path_, fmt::format("cannot read tensor '{}'", name));
  if (width == 4) {
    std::memcpy(out, raw.data(), raw.size());
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint16_t bits = 0;
    std::memcpy(&bits, raw.data() + 2 * i, 2);
    out[i] = bfloat16_to_float(bits);
  }
}

}  // namespace meshrun
