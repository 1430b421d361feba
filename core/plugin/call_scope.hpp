// Which plugin entry point the core is inside, so that a crash there names
// the plugin instead of leaving a bare "Segmentation fault": the CLI installs
// a handler that reads it.
#pragma once

#include <atomic>
#include <string>
#include <utility>

#include "plugin/loader.hpp"

namespace meshrun {

// Records, for its lifetime, that the core is calling `entry_point` (a
// string literal, e.g. "plan") of the plugin `library`. Scopes nest. The
// core calls plugins from one thread, so one process-wide record is enough,
// and a crash on a thread of the plugin's own is blamed on the call that
// waits for it.
class PluginCallScope {
 public:
  PluginCallScope(const PluginLibrary& library, const char* entry_point) noexcept
      : PluginCallScope(library.path(), library.kind(), entry_point) {}
  // For a plugin file not loaded yet, of the kind its name says.
  PluginCallScope(const std::string& path, PluginKind kind, const char* entry_point) noexcept;
  ~PluginCallScope();
  PluginCallScope(const PluginCallScope&) = delete;
  PluginCallScope& operator=(const PluginCallScope&) = delete;

  // What the crash handler reads: plain pointers, valid while the scope lives.
  struct Call {
    const char* path;
    PluginKind kind;
    const char* entry_point;
    const Call* enclosing;
  };
  static const Call* current() noexcept { return current_.load(); }

 private:
  static inline std::atomic<const Call*> current_{nullptr};
  Call call_;
};

// Runs `call`, a call of `entry_point` of the plugin `library`, inside a
// PluginCallScope, and returns what it returns.
template <class Call>
decltype(auto) call_plugin(const PluginLibrary& library, const char* entry_point, Call&& call) {
  const PluginCallScope scope(library, entry_point);
  return std::forward<Call>(call)();
}

// Installs handlers of SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT that, when
// the signal arrives inside a PluginCallScope, print one line naming the
// plugin file, the signal and the entry point, then let the signal end the
// process as it would have without them.
void install_plugin_crash_handler();

}  // namespace meshrun
