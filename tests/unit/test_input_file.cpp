// Files a run reads whole: only regular files of bounded size pass, and the
// check never blocks on a FIFO or reads a device.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/input_file.hpp"
#include "temp_folder.hpp"

namespace fs = std::filesystem;

namespace {

using Catch::Contains;
using meshrun::unreadable_input_file;

std::string problem_of(const std::string& path, int64_t max_bytes) {
  const auto problem = unreadable_input_file(path, max_bytes);
  REQUIRE(problem.has_value());
  return *problem;
}

}  // namespace

TEST_CASE("input file: a regular file within the limit passes", "[input_file]") {
  const TempFolder folder("meshrun-input-file");
  const std::string path = folder.file("data.txt");
  std::ofstream(path) << "0123456789";
  CHECK_FALSE(unreadable_input_file(path, 10).has_value());
  CHECK_THAT(problem_of(path, 9),
             Contains("'" + path + "' has 10 bytes; expected a regular file of at most"));
}

TEST_CASE("input file: what is not a regular file is refused without reading it", "[input_file]") {
  const TempFolder folder("meshrun-input-file");
  const std::string fifo = folder.file("fifo");
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(problem_of(fifo, 1 << 20),
             Contains("is a FIFO (named pipe); expected a regular file"));
  CHECK_THAT(problem_of("/dev/zero", 1 << 20),
             Contains("'/dev/zero' is a character device; expected a regular file"));
  CHECK_THAT(problem_of(folder.path(), 1 << 20), Contains("is a directory"));
  CHECK_THAT(problem_of(folder.file("missing"), 1 << 20),
             Contains("cannot read '" + folder.file("missing") +
                      "': No such file or directory; expected an existing regular file"));
}

TEST_CASE("input file: the data limit is 4 GiB, checked from the size alone", "[input_file]") {
  const TempFolder folder("meshrun-input-file");
  const std::string sparse = folder.file("sparse");
  std::ofstream(sparse).close();
  fs::resize_file(sparse, uintmax_t(meshrun::kMaxDataFileBytes) + 1);  // no blocks written
  CHECK_THAT(problem_of(sparse, meshrun::kMaxDataFileBytes),
             Contains("has 4294967297 bytes; expected a regular file of at most 4 GiB "
                      "(4294967296 bytes)"));
  fs::resize_file(sparse, uintmax_t(meshrun::kMaxDataFileBytes));
  CHECK_FALSE(unreadable_input_file(sparse, meshrun::kMaxDataFileBytes).has_value());
  CHECK_THAT(problem_of(sparse, meshrun::kMaxScheduleCsvBytes), Contains("at most 64 MiB"));
}
