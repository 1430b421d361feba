// What the C host API's files share: the objects behind its opaque handles
// and the guard every entry point runs in. Internal to libmeshrun.so.
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

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

// `error` with its message prefixed by the host call that returned it
// ("meshrun_strategy_create: ..."), so a host's log names the call.
meshrun_error* named(const char* call, meshrun_error* error) noexcept;

// Runs `body` as the body of host call `call` (pass __func__), turning a
// meshrun::Error into an error object with its code; anything else becomes
// INTERNAL (the plugin helper's guard does that). Every message names `call`.
template <class Body>
meshrun_error* guarded(const char* call, Body&& body) noexcept {
  return named(call, meshrun::plugin::guard([&] {
                 try {
                   body();
                 } catch (const Error& error) {
                   throw meshrun::plugin::Error(error.code(), error.what());
                 }
               }));
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

// The C type name of each handle the API returns, for messages.
template <class Handle>
constexpr const char* handle_type = nullptr;
template <>
inline constexpr const char* handle_type<meshrun_runtime> = "meshrun_runtime";
template <>
inline constexpr const char* handle_type<meshrun_comm> = "meshrun_comm";
template <>
inline constexpr const char* handle_type<meshrun_op> = "meshrun_op";
template <>
inline constexpr const char* handle_type<meshrun_strategy> = "meshrun_strategy";

// The handles this library returned and has not destroyed, with their type:
// a call given a destroyed, never-made or wrong-typed handle gets an error
// instead of reading freed memory. Only addresses are compared, never
// dereferenced. Thread-safe.
void register_handle(const void* handle, const char* type);
// Forgets `handle`; false when it was not live (destroyed twice, or never
// made), and then the caller must not free it.
bool forget_handle(const void* handle);
// Throws INVALID_ARGUMENT naming `argument` unless `handle` is a live
// handle of `type` (NULL included).
void require_live(const void* handle, const char* type, const char* argument);

// `handle`, checked live as `argument`.
template <class Handle>
Handle& live(Handle* handle, const char* argument) {
  require_live(handle, handle_type<std::remove_const_t<Handle>>, argument);
  return *handle;
}

// Takes ownership of a new handle from `made` and registers it.
template <class Handle>
Handle* adopt(std::unique_ptr<Handle> made) {
  register_handle(made.get(), handle_type<Handle>);
  return made.release();
}

}  // namespace meshrun::host_api
