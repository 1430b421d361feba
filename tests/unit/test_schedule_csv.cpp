// Schedules from PyTorch's CSV format: a compute-only file is lowered (and
// then equals the lowered generated schedule), one with communication is
// taken as written, and a malformed one is refused naming the row and
// column.
#include <stdlib.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "test_schedule_support.hpp"

namespace fs = std::filesystem;

namespace {

using Catch::Contains;
using meshrun::schedule::generate;
using meshrun::schedule::lower;
using meshrun::schedule::read_csv;
using meshrun::schedule::Schedule;
using schedule_testing::error_of;
using schedule_testing::shipped_schedule;
using schedule_testing::Strings;
using schedule_testing::strings_of;

// A CSV file in a fresh temporary folder, removed afterwards.
class CsvFile {
 public:
  explicit CsvFile(const std::string& text) {
    std::string pattern = (fs::temp_directory_path() / "meshrun-csv-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    folder_ = pattern;
    path_ = folder_ + "/schedule.csv";
    std::ofstream(path_) << text;
  }
  ~CsvFile() {
    std::error_code ignored;
    fs::remove_all(folder_, ignored);
  }
  CsvFile(const CsvFile&) = delete;
  CsvFile& operator=(const CsvFile&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string folder_;
  std::string path_;
};

std::string csv_of(const Strings& ranks) {
  std::string text;
  for (const auto& row : ranks) {
    for (size_t i = 0; i < row.size(); ++i) text += (i == 0 ? "" : ",") + row[i];
    text += "\n";
  }
  return text;
}

// The message read_csv refuses `text` with, for pp 2, one stage per rank.
std::string refused(const std::string& text, int64_t microbatches = 1) {
  const CsvFile file(text);
  const std::string message = error_of([&] { read_csv(file.path(), 2, 1, microbatches); });
  CHECK_THAT(message, Contains(file.path()));
  return message;
}

}  // namespace

TEST_CASE("schedule CSV: a compute-only file with idle cells is lowered like the generated one",
          "[schedule][csv]") {
  // PyTorch's 1F1B pipeline_order for pp 2, m 4, idle steps included.
  const CsvFile file(
      "0F0,,,0F1,0B0,0F2,0B1,0F3,0B2,,0B3\n"
      ",1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n");
  const Schedule from_file = read_csv(file.path(), 2, 1, 4);
  const Schedule generated = lower(generate(shipped_schedule("1f1b"), 2, 1, 4));
  CHECK(strings_of(from_file) == strings_of(generated));
  CHECK(from_file.stage_rank == generated.stage_rank);
  CHECK(from_file.csv_path == file.path());
  CHECK(from_file.csv_columns[0][0] == 1);
  CHECK(from_file.csv_columns[0][1] == 0);  // the SEND_F lowering added
}

TEST_CASE("schedule CSV: the V placement is read from the file", "[schedule][csv]") {
  const Schedule generated = generate(shipped_schedule("zbv_zero_bubble"), 2, 2, 4);
  const CsvFile file(csv_of(strings_of(generated)));
  const Schedule from_file = read_csv(file.path(), 2, 2, 4);
  CHECK(from_file.stage_rank == std::vector<int64_t>{0, 1, 1, 0});
  CHECK(strings_of(from_file) == strings_of(lower(generated)));
}

TEST_CASE("schedule CSV: a file with communication is taken as written", "[schedule][csv]") {
  const Strings written = {
      {"0F0", "0SEND_F0", "0F1", "0SEND_F1", "", "0RECV_B0", "0B0", "0RECV_B1", "0B1"},
      {"1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"}};
  // Windows line ends and blank lines after the last row are fine.
  std::string text;
  for (const char c : csv_of(written) + "\n,\n") {
    if (c == '\n') text += '\r';
    text += c;
  }
  const CsvFile file(text);
  CHECK(strings_of(read_csv(file.path(), 2, 1, 2)) == written);
}

TEST_CASE("schedule CSV: malformed files are refused naming the row and column",
          "[schedule][csv]") {
  CHECK_THAT(refused("0F0,0X0,0B0\n1F0,1B0\n"),
             Contains("row 1, column 2: '0X0' is not an action"));
  CHECK_THAT(refused("0F0,0F0,0B0\n1F0,1B0\n"),
             Contains("rank 0 step 1 (") && Contains("row 1, column 2): 0F0: runs a second time"));
  CHECK_THAT(refused("0F0,0I0,0W0\n1F0,,1W0,1I0\n"),
             Contains("row 2, column 3): 1W0: runs before the I of its microbatch"));
  CHECK_THAT(refused("0F0,0B0\n1F0,1B0\n", 2),
             Contains("rank 0 step 2") &&
                 Contains("row 1, column 3: the end of the row): stage 0 never runs F for "
                          "microbatch 1"));
  CHECK_THAT(refused("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"),
             Contains("the schedule deadlocks with blocking sends and receives: rank 0 step 1") &&
                 Contains("row 1, column 2): 0RECV_B0 waits for rank 1; rank 1 step 0") &&
                 Contains("row 2, column 1): 1RECV_F0 waits for rank 0"));
  CHECK_THAT(refused("0F0,5F0\n1F0\n"),
             Contains("row 1, column 2: 5F0: stage 5 does not exist (pp * stages_per_rank = 2 "
                      "stages)"));
  CHECK_THAT(refused("0F0,0B0\n1F0,1B0,0B0\n"),
             Contains("row 2, column 3): 0B0: stage 0 is placed on rank 0, not on rank 1"));
  CHECK_THAT(refused("0F0,0B1\n1F0,1B0\n"),
             Contains("row 1, column 2): 0B1: microbatch 1 does not exist"));
  CHECK_THAT(refused("0F0,0B0\n1F0,1B0\n1F0\n"),
             Contains("3 rows, but a schedule for pp 2 needs one row per rank"));
}

TEST_CASE("schedule CSV: a missing file or one that is not a regular file is refused",
          "[schedule][csv]") {
  const auto refused = [](const std::string& path) {
    return error_of([&] { read_csv(path, 2, 1, 1); }, MESHRUN_INVALID_ARGUMENT);
  };
  CHECK_THAT(refused("/nonexistent/schedule.csv"),
             Contains("schedule CSV: cannot read '/nonexistent/schedule.csv'"));
  // Read whole, /dev/zero would fill the memory; a FIFO would block the open.
  CHECK_THAT(refused("/dev/zero"), Contains("schedule CSV: '/dev/zero' is a character device"));
  const CsvFile file("");
  const std::string fifo = file.path() + ".fifo";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(refused(fifo), Contains("is a FIFO (named pipe); expected a regular file"));
  fs::remove(fifo);
}
