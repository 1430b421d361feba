// The live-handle registry and the call-naming of error messages that every
// host entry point shares (host_api.hpp).
#include <fmt/format.h>

#include <mutex>
#include <string_view>
#include <unordered_map>

#include "host_api.hpp"

namespace meshrun::host_api {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, const char*> live;  // handle -> its type
};

// Never destroyed: a host may destroy handles from its own static
// destructors or atexit handlers, after this library's statics would be gone.
Registry& registry() {
  static auto* const instance = new Registry;
  return *instance;
}

}  // namespace

void register_handle(const void* handle, const char* type) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  r.live[handle] = type;
}

bool forget_handle(const void* handle) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  return r.live.erase(handle) == 1;
}

void require_live(const void* handle, const char* type, const char* argument) {
  require(handle, argument);
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto found = r.live.find(handle);
  if (found == r.live.end()) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                fmt::format("argument '{}' is not a live {}: it was destroyed, or never "
                            "returned by this library",
                            argument, type));
  }
  if (std::string_view(found->second) != type) {
    throw Error(MESHRUN_INVALID_ARGUMENT,
                fmt::format("argument '{}' is a {}, not a {}", argument, found->second, type));
  }
}

meshrun_error* named(const char* call, meshrun_error* error) noexcept {
  if (error == nullptr) return nullptr;
  try {
    meshrun_error* renamed =
        meshrun::plugin::make_error(error->code, fmt::format("{}: {}", call, error->message));
    meshrun_error_release(error);
    return renamed;
  } catch (...) {  // no memory for the longer message: the error as it was
    return error;
  }
}

}  // namespace meshrun::host_api
