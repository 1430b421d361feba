// meshrun/plugin.hpp — header-only C++ helper for plugin authors.
//
// Lets a C++ plugin throw meshrun::plugin::Error (or any std::exception) and
// turns it into a meshrun_error at the ABI boundary, and implements the
// create/destroy pair of the plugin table for a C++ class. Nothing here needs
// libmeshrun: it is all inline, so the plugin still exports one symbol only.
//
//   struct MyStrategy {
//     explicit MyStrategy(const meshrun_host_services& host);
//   };
//   static const meshrun_plugin_api api = {
//       ..., &meshrun::plugin::create_instance<MyStrategy>,
//       &meshrun::plugin::destroy_instance<MyStrategy>, ...};
#ifndef MESHRUN_PLUGIN_HPP_
#define MESHRUN_PLUGIN_HPP_

#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "meshrun/plugin.h"

namespace meshrun::plugin {

// An exception that becomes a meshrun_error with `code` at the boundary.
class Error : public std::exception {
 public:
  Error(int32_t code, std::string message) : code_(code), message_(std::move(message)) {}
  int32_t code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  int32_t code_;
  std::string message_;
};

// An error object a host callback returned (a model stage's hook): guard()
// hands that same object back from the entry point, so it reaches the host
// that made it unchanged. Copies share the one object.
class HostError : public std::exception {
 public:
  explicit HostError(meshrun_error* error) : held_(std::make_shared<Held>(error)) {}
  const char* what() const noexcept override {
    return held_->error != nullptr && held_->error->message != nullptr ? held_->error->message
                                                                       : "host error";
  }
  int32_t code() const noexcept {
    return held_->error != nullptr ? held_->error->code : MESHRUN_INTERNAL;
  }
  // The error object, now the caller's; NULL when it was taken before.
  meshrun_error* take() noexcept { return std::exchange(held_->error, nullptr); }

 private:
  struct Held {
    explicit Held(meshrun_error* error) : error(error) {}
    ~Held() { meshrun_error_release(error); }
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    meshrun_error* error;
  };
  std::shared_ptr<Held> held_;
};

namespace detail {
// The error object this helper allocates: the ABI header plus its storage.
struct OwnedError {
  meshrun_error header;
  std::string text;
};

inline void destroy_owned_error(meshrun_error* error) {
  delete reinterpret_cast<OwnedError*>(error);
}

inline void keep_static_error(meshrun_error*) {}

// Returned when even the error cannot be allocated: NULL would read as
// success. Static, so its destroy does nothing.
inline meshrun_error* out_of_memory_error() noexcept {
  static meshrun_error error = {sizeof(meshrun_error), MESHRUN_INTERNAL,
                                "out of memory while reporting an error", &keep_static_error};
  return &error;
}
}  // namespace detail

// Makes an error owned by the caller, freed by this plugin's own destroy.
// Never returns NULL.
inline meshrun_error* make_error(int32_t code, const std::string& message) noexcept {
  auto* owned = new (std::nothrow) detail::OwnedError{};
  if (owned == nullptr) return detail::out_of_memory_error();
  try {
    owned->text = message;
  } catch (...) {
    owned->text.clear();
  }
  owned->header.struct_size = sizeof(meshrun_error);
  owned->header.code = code;
  owned->header.message = owned->text.c_str();
  owned->header.destroy = &detail::destroy_owned_error;
  return &owned->header;
}

// Runs `body` and converts whatever it throws into an error; NULL on success.
// Use it as the whole body of every function the plugin exposes.
template <class Body>
meshrun_error* guard(Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (HostError& e) {
    meshrun_error* error = e.take();
    return error != nullptr ? error : make_error(e.code(), e.what());
  } catch (const Error& e) {
    return make_error(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return make_error(MESHRUN_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return make_error(MESHRUN_INTERNAL, e.what());
  } catch (...) {
    return make_error(MESHRUN_INTERNAL, "unknown C++ exception");
  }
}

// Throws INVALID_ARGUMENT unless `host` is usable by a plugin built against
// this header's ABI 1.0 (non-NULL, same major, large enough).
inline void require_host(const meshrun_host_services* host) {
  if (host == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "host services table is NULL");
  if (host->struct_size < MESHRUN_HOST_SERVICES_SIZE_1_0) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                "host services table too small: struct_size " + std::to_string(host->struct_size) +
                    " < " + std::to_string(MESHRUN_HOST_SERVICES_SIZE_1_0) + " (ABI 1.0)");
  }
  if (host->abi_major != MESHRUN_ABI_VERSION_MAJOR) {
    throw Error(MESHRUN_VERSION_MISMATCH, "host ABI major " + std::to_string(host->abi_major) +
                                              ", plugin built for " +
                                              std::to_string(MESHRUN_ABI_VERSION_MAJOR));
  }
}

// Instance state for a plugin that so far keeps only the host services it
// may call; a plugin with real state defines its own class instead.
class HostServicesOnly {
 public:
  explicit HostServicesOnly(const meshrun_host_services& host) : host_(&host) {}
  const meshrun_host_services& host() const { return *host_; }

 private:
  const meshrun_host_services* host_;
};

// The `create` entry of a plugin table for a class constructible from the
// host services. The instance pointer handed out is the T object itself.
template <class T>
meshrun_error* create_instance(const meshrun_host_services* host,
                               meshrun_plugin_instance** out) noexcept {
  return guard([&] {
    if (out == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "create: out is NULL");
    require_host(host);
    *out = reinterpret_cast<meshrun_plugin_instance*>(new T(*host));
  });
}

// The `destroy` entry matching create_instance<T>; accepts NULL.
template <class T>
void destroy_instance(meshrun_plugin_instance* instance) noexcept {
  delete reinterpret_cast<T*>(instance);
}

}  // namespace meshrun::plugin

#endif  // MESHRUN_PLUGIN_HPP_
