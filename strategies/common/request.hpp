// A comm request a strategy owns: destroyed (after waiting for it) when the
// object goes, so an operation abandoned by an error never outlives the
// buffers it reads and writes, as long as it is declared after them.
#pragma once

#include <string>

#include "meshrun/comm.h"

namespace meshrun::strategies {

class Request {
 public:
  Request() = default;
  // Owns `handle`, which `comm` made.
  Request(const meshrun_comm_api& comm, meshrun_request* handle) : comm_(&comm), handle_(handle) {}
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  // True once the operation has completed; throws its error with `context`.
  bool test(const std::string& context);
  // Returns once the operation has completed; throws its error with `context`.
  void wait(const std::string& context);
  // True while it holds an operation not yet found complete.
  bool pending() const { return handle_ != nullptr; }

 private:
  void reset();

  const meshrun_comm_api* comm_ = nullptr;
  meshrun_request* handle_ = nullptr;  // NULL once completed
};

}  // namespace meshrun::strategies
