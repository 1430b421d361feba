// What the safetensors reader refuses (huggingface/safetensors' rules: each
// entry's byte range is numel x the dtype's size, the ranges tile the data
// section) and how a write the disk refuses is reported.
#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "state/durable_io.hpp"
#include "state/safetensors.hpp"
#include "temp_folder.hpp"

using namespace meshrun;
using Catch::Matchers::Contains;

namespace {

// A file of an 8-byte length, `header` and `data_bytes` zero bytes.
std::string safetensors_file(const std::string& header, size_t data_bytes) {
  // One folder per process: the plain and sanitized tiers run these cases
  // side by side, each in a process of its own.
  static const TempFolder folder("meshrun-test-safetensors");
  const std::string path = folder.file("invalid.safetensors");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = header.size();
  for (int byte = 0; byte < 8; ++byte) out.put(char((length >> (8 * byte)) & 0xff));
  out << header << std::string(data_bytes, '\0');
  return path;
}

std::string refusal(const std::string& header, size_t data_bytes) {
  try {
    meshrun::SafetensorsFile file(safetensors_file(header, data_bytes));
  } catch (const Error& error) {
    CHECK(error.is_input_error());
    return error.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("safetensors: a valid header reads, metadata included", "[safetensors]") {
  const meshrun::SafetensorsFile file(
      safetensors_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"BF16","shape":[2,1],"data_offsets":[8,12]},)"
                       R"("__metadata__":{"meshrun.rank":"1"}})",
                       12));
  CHECK(file.tensors().at("b").numel == 2);
  CHECK(file.metadata().at("meshrun.rank") == "1");
  float values[2] = {1, 1};
  file.read("b", 0, 2, values);
  CHECK(values[1] == 0.0f);
  CHECK_THROWS_WITH(file.read("c", 0, 1, values), Contains("holds no tensor 'c'"));
  CHECK_THROWS_WITH(file.read("a", 1, 2, values),
                    Contains("tensor 'a' has 2 elements; elements [1, 3) were asked"));
}

TEST_CASE("safetensors: byte ranges must be numel x the dtype's size", "[safetensors]") {
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-4,4]}})", 8),
             Contains("tensor 'a' has data_offsets [-4,4]; valid: [begin, end] with 0 <= begin"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
             Contains("tensor 'a' has data_offsets [0, 8] (8 bytes); its shape [3] in F32 needs 3 "
                      "elements x 4 bytes"));
  // float32 bytes labelled BF16: twice the bytes the label needs.
  CHECK_THAT(refusal(R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 8),
             Contains("its shape [2] in BF16 needs 2 elements x 2 bytes"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0),
             Contains("has shape [-1]: extents must be non-negative"));
  CHECK_THAT(
      refusal(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
      Contains("their product fit in 64 bits"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8),
             Contains("tensor 'a' has dtype I64; F32 and BF16 are read"));
}

TEST_CASE("safetensors: tensors tile the data section", "[safetensors]") {
  // b points into a.
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                     8),
             Contains("tensor 'b' begins at data byte 4, but tensor 'a' ends at 8"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
             Contains("tensor 'a' begins at data byte 4, but the start of the data ends at 0"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
             Contains("the tensors' data end at byte 8, the file's data section holds 4 bytes"));
  CHECK_THAT(refusal(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8),
             Contains("the tensors' data end at byte 4, the file's data section holds 8 bytes"));
}

TEST_CASE("safetensors: a header that is not one is refused", "[safetensors]") {
  const std::string path = safetensors_file("{}", 0);
  std::filesystem::resize_file(path, 4);
  CHECK_THROWS_WITH(meshrun::SafetensorsFile(path), Contains("not a safetensors file"));
  CHECK_THAT(refusal("[1, 2]", 0), Contains("the safetensors header is not a JSON object"));
  CHECK_THAT(refusal(R"({"__metadata__":{"n":1}})", 0),
             Contains("__metadata__ 'n' is 1; the format's metadata values are strings"));
}

TEST_CASE("safetensors: a write the disk refuses names the file and the bytes missing",
          "[safetensors]") {
  if (!std::filesystem::exists("/dev/full")) return;
  meshrun::OutputFile out("/dev/full", "model.safetensors");
  const std::vector<char> bytes(100, 'x');
  CHECK_THROWS_WITH(out.write(bytes.data(), bytes.size(), 1000),
                    Contains("cannot write 'model.safetensors' (through '/dev/full'): 1000 bytes "
                             "missing, 0 written (No space left on device)"));
}
