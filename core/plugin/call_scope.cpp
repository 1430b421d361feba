#include "plugin/call_scope.hpp"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <cstddef>

namespace meshrun {
namespace {

// The handler may only read the record if that takes no lock.
static_assert(std::atomic<const PluginCallScope::Call*>::is_always_lock_free);

constexpr std::array<std::pair<int, const char*>, 5> kCrashSignals = {{
    {SIGSEGV, "SIGSEGV"},
    {SIGBUS, "SIGBUS"},
    {SIGFPE, "SIGFPE"},
    {SIGILL, "SIGILL"},
    {SIGABRT, "SIGABRT"},
}};

// A line built without allocating, for a signal handler; what does not fit
// is cut off.
class Line {
 public:
  void add(const char* text) {
    for (; *text != '\0' && size_ < text_.size(); ++text) text_[size_++] = *text;
  }
  void add(unsigned number) {
    std::array<char, 10> digits{};
    size_t count = 0;
    do {
      digits[count++] = static_cast<char>('0' + number % 10);
      number /= 10;
    } while (number != 0);
    while (count > 0 && size_ < text_.size()) text_[size_++] = digits[--count];
  }
  void write_to(int fd) const {
    size_t written = 0;
    while (written < size_) {
      const ssize_t result = ::write(fd, text_.data() + written, size_ - written);
      if (result <= 0) return;
      written += static_cast<size_t>(result);
    }
  }

 private:
  std::array<char, 8192> text_{};
  size_t size_ = 0;
};

// The kind as string literals: plugin_kind_name's views are not promised
// to be NUL-terminated.
const char* kind_text(PluginKind kind) {
  switch (kind) {
    case PluginKind::strategy:
      return "strategy";
    case PluginKind::schedule:
      return "schedule";
    case PluginKind::sidecar:
      return "sidecar";
    case PluginKind::comm:
      return "comm";
    case PluginKind::model:
      return "model";
  }
  return "plugin";
}

// Async-signal-safe: write(2), sigaction and raise only.
void on_crash(int signal_number) {
  if (const PluginCallScope::Call* call = PluginCallScope::current()) {
    const char* name = "unknown signal";
    for (const auto& [number, signal_name] : kCrashSignals) {
      if (number == signal_number) name = signal_name;
    }
    Line line;
    line.add("meshrun: error: plugin ");
    line.add(call->path);
    line.add(" crashed (signal ");
    line.add(static_cast<unsigned>(signal_number));
    line.add(", ");
    line.add(name);
    line.add(") in ");
    line.add(kind_text(call->kind));
    line.add(" ");
    line.add(call->entry_point);
    line.add("\n");
    line.write_to(STDERR_FILENO);
  }
  // The signal stays blocked until this handler returns, and then ends the
  // process with its default action, so the exit status still shows it.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  sigaction(signal_number, &default_action, nullptr);
  raise(signal_number);
}

}  // namespace

PluginCallScope::PluginCallScope(const std::string& path, PluginKind kind,
                                 const char* entry_point) noexcept
    : call_{path.c_str(), kind, entry_point, current_.load()} {
  current_.store(&call_);
}

PluginCallScope::~PluginCallScope() { current_.store(call_.enclosing); }

void install_plugin_crash_handler() {
  // A plugin that overflows its stack can only be reported from another.
  static std::array<char, 64 * 1024> alternate_stack;
  stack_t stack{};
  stack.ss_sp = alternate_stack.data();
  stack.ss_size = alternate_stack.size();
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_handler = &on_crash;
  action.sa_flags = SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (const auto& signal : kCrashSignals) sigaction(signal.first, &action, nullptr);
}

}  // namespace meshrun
