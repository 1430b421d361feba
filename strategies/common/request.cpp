#include "common/request.hpp"

#include <cstdint>
#include <utility>

#include "common/errors.hpp"

namespace meshrun::strategies {

Request::Request(Request&& other) noexcept
    : comm_(other.comm_), handle_(std::exchange(other.handle_, nullptr)) {}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    reset();
    comm_ = other.comm_;
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

Request::~Request() { reset(); }

void Request::reset() {
  if (handle_ != nullptr) comm_->request_destroy(std::exchange(handle_, nullptr));
}

bool Request::test(const std::string& context) {
  if (handle_ == nullptr) return true;
  int32_t done = 0;
  throw_if_error(comm_->test(handle_, &done), context);
  if (done == 0) return false;
  wait(context);
  return true;
}

void Request::wait(const std::string& context) {
  if (handle_ == nullptr) return;
  meshrun_error* error = comm_->wait(handle_, -1.0);
  reset();
  throw_if_error(error, context);
}

}  // namespace meshrun::strategies
