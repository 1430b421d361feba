// What the multi-process strategy tests share: a rank's record of failed
// checks, the check that a call fails with the right error, and the verdict
// every rank agrees on.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "errors.hpp"

namespace meshrun::test {

class Checker {
 public:
  explicit Checker(int64_t rank) : rank_(rank) {}
  void check(bool ok, const std::string& what) {
    if (ok) return;
    ++failures_;
    std::fprintf(stderr, "rank %lld: FAILED: %s\n", static_cast<long long>(rank_), what.c_str());
  }
  // Runs `body`, expecting a meshrun::Error of `code` whose message contains
  // every one of `parts`.
  void expect_error(const std::string& what, int32_t code, const std::vector<std::string>& parts,
                    const std::function<void()>& body) {
    try {
      body();
      check(false, what + ": no error");
    } catch (const meshrun::Error& e) {
      const std::string message = e.what();
      check(e.code() == code, what + ": code " + std::to_string(e.code()) + " (" + message + ")");
      for (const auto& part : parts) {
        check(message.find(part) != std::string::npos,
              what + ": message lacks '" + part + "': " + message);
      }
    }
  }
  int failures() const { return failures_; }

 private:
  int64_t rank_;
  int failures_ = 0;
};

// Every rank learns whether any rank failed; rank 0 prints the verdict as
// "<test>: passed" or "<test>: FAILED". Returns the exit status.
inline int verdict(Communicator& world, const Checker& checker, const char* test) {
  float failed = checker.failures() > 0 ? 1.0f : 0.0f;
  FlatTensor tensor(&failed, dtype_float32(), 1);
  world.all_reduce(tensor.get(), ReduceOp::max).wait();
  if (world.rank() == 0) std::printf("%s: %s\n", test, failed > 0 ? "FAILED" : "passed");
  return failed > 0 ? 1 : 0;
}

}  // namespace meshrun::test
