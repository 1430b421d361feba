#include "train/safetensors.hpp"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "errors.hpp"
#include "tensor/elements.hpp"

namespace meshrun::train {
namespace {

int64_t element_bytes(const std::string& dtype) { return dtype == "BF16" ? 2 : 4; }

std::string header_json(const std::vector<TensorToWrite>& tensors, const std::string& dtype) {
  nlohmann::ordered_json header;
  int64_t offset = 0;
  for (const auto& tensor : tensors) {
    const int64_t bytes = tensor.numel * element_bytes(dtype);
    header[tensor.name] = {
        {"dtype", dtype}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  // Pads with spaces (the format allows them) so the data starts 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_tensor(std::ofstream& out, const TensorToWrite& tensor, bool bfloat16) {
  if (!bfloat16) {
    out.write(reinterpret_cast<const char*>(tensor.data), tensor.numel * 4);
    return;
  }
  std::vector<uint16_t> bits(tensor.numel);
  for (int64_t i = 0; i < tensor.numel; ++i) bits[i] = float_to_bfloat16(tensor.data[i]);
  out.write(reinterpret_cast<const char*>(bits.data()), tensor.numel * 2);
}

Error file_error(const std::string& path, const std::string& what) {
  return invalid_argument(fmt::format("{}: {}", path, what));
}

StoredTensor parse_entry(const std::string& path, const std::string& name,
                         const nlohmann::json& entry) {
  StoredTensor tensor;
  tensor.dtype = entry.at("dtype").get<std::string>();
  if (tensor.dtype != "F32" && tensor.dtype != "BF16") {
    throw file_error(
        path, fmt::format("tensor '{}' has dtype {}; F32 and BF16 are read", name, tensor.dtype));
  }
  tensor.shape = entry.at("shape").get<std::vector<int64_t>>();
  const auto offsets = entry.at("data_offsets").get<std::vector<int64_t>>();
  if (offsets.size() != 2 || offsets[1] < offsets[0]) {
    throw file_error(path, fmt::format("tensor '{}' has bad data_offsets", name));
  }
  tensor.begin = offsets[0];
  tensor.end = offsets[1];
  return tensor;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       bool bfloat16) {
  const std::string temporary = path + ".partial";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    const std::string header = header_json(tensors, bfloat16 ? "BF16" : "F32");
    const auto length = uint64_t(header.size());
    for (int byte = 0; byte < 8; ++byte) out.put(char((length >> (8 * byte)) & 0xff));
    out << header;
    for (const auto& tensor : tensors) write_tensor(out, tensor, bfloat16);
    if (!out.flush()) throw Error(MESHRUN_INTERNAL, "cannot write " + temporary);
  }
  std::filesystem::rename(temporary, path);
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_, std::ios::binary);
  if (!in) throw file_error(path_, "cannot be read");
  unsigned char length_bytes[8] = {};
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  uint64_t length = 0;
  for (int byte = 7; byte >= 0; --byte) length = (length << 8) | length_bytes[byte];
  const auto file_size = std::filesystem::file_size(path_);
  if (!in || length > file_size - 8) throw file_error(path_, "not a safetensors file");
  std::string header(length, '\0');
  in.read(header.data(), std::streamsize(length));
  data_start_ = int64_t(8 + length);
  try {
    const nlohmann::json parsed = nlohmann::json::parse(header);
    for (const auto& [name, entry] : parsed.items()) {
      if (name != "__metadata__") tensors_[name] = parse_entry(path_, name, entry);
    }
  } catch (const nlohmann::json::exception& error) {
    throw file_error(path_, std::string("bad safetensors header: ") + error.what());
  }
  for (const auto& [name, tensor] : tensors_) {
    if (data_start_ + tensor.end > int64_t(file_size)) {
      throw file_error(path_, fmt::format("tensor '{}' lies beyond the end of the file", name));
    }
  }
}

void SafetensorsFile::read(const std::string& name, int64_t first, int64_t count,
                           float* out) const {
  const StoredTensor& tensor = tensors_.at(name);
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

}  // namespace meshrun::train
