// What the C host API's files share: the objects behind its opaque handles
// and the guard every entry point runs in. Internal to libmeshrun.so.
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>

#include "errors.hpp"
#include "meshrun/host.h"
#include "meshrun/plugin.hpp"
#include "runtime/runtime.hpp"

struct meshrun_runtime {
  meshrun::Runtime runtime;
  std::map<std::string, std::unique_ptr<meshrun_comm>> comms;  // made on first ask
};

// A communicator of a joined job; keeps the job alive.
struct meshrun_comm {
  std::shared_ptr<meshrun::Job> job;
  meshrun::Communicator* communicator;
};

// An operation in flight; keeps the job alive until it is done.
struct meshrun_op {
  std::shared_ptr<meshrun::Job> job;
  meshrun::Request request;
};

namespace meshrun::host_api {

// Runs `body`, turning a meshrun::Error into an error object with its code;
// anything else becomes INTERNAL (the plugin helper's guard does that).
template <class Body>
meshrun_error* guarded(Body&& body) noexcept {
  return meshrun::plugin::guard([&] {
    try {
      body();
    } catch (const Error& error) {
      throw meshrun::plugin::Error(error.code(), error.what());
    }
  });
}

// A copy of `text` from malloc, as meshrun_string_destroy frees it.
inline char* malloc_string(const std::string& text) {
  auto* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) throw std::bad_alloc();
  std::memcpy(copy, text.c_str(), text.size() + 1);
  return copy;
}

// Throws INVALID_ARGUMENT naming the argument when `pointer` is NULL.
inline void require(const void* pointer, const char* name) {
  if (pointer == nullptr) {
    throw Error(MESHRUN_INVALID_ARGUMENT, std::string("argument '") + name + "' is NULL");
  }
}

}  // namespace meshrun::host_api
