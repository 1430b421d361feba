// The host API's trace (abi/include/meshrun/host.h, ABI 1.12): a host that
// trains itself records the spans `meshrun train` records with
// train.profile, and writes the same trace.json.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>

#include "host_api.hpp"
#include "meshrun/host.h"
#include "state/durable_io.hpp"
#include "trace/trace.hpp"

namespace {

using meshrun::host_api::guarded;
using meshrun::host_api::require;
using meshrun::trace::Trace;

// The category constant `name` names, for spans that outlive the call.
const char* category_named(const char* name) {
  require(name, "category");
  for (const char* category : {meshrun::trace::kComputeSpan, meshrun::trace::kCommSpan,
                               meshrun::trace::kIdleSpan, meshrun::trace::kStepSpan}) {
    if (std::strcmp(name, category) == 0) return category;
  }
  throw meshrun::Error(
      MESHRUN_INVALID_ARGUMENT,
      std::string("category '") + name + "': expected \"compute\", \"comm\", \"idle\" or \"step\"");
}

Trace::Clock::time_point at(double seconds) {
  return Trace::Clock::time_point(
      std::chrono::duration_cast<Trace::Clock::duration>(std::chrono::duration<double>(seconds)));
}

}  // namespace

meshrun_error* meshrun_trace_start(meshrun_runtime* runtime) {
  return guarded(__func__, [&] {
    meshrun::host_api::live(runtime, "runtime");
    Trace::process().start(runtime->runtime.job()->host_world());
  });
}

double meshrun_trace_now(void) {
  return std::chrono::duration<double>(Trace::Clock::now().time_since_epoch()).count();
}

meshrun_error* meshrun_trace_span(const char* name, const char* category, double begin_seconds,
                                  double end_seconds) {
  return guarded(__func__, [&] {
    require(name, "name");
    const char* kind = category_named(category);
    if (!(end_seconds >= begin_seconds)) {
      throw meshrun::Error(MESHRUN_INVALID_ARGUMENT, "a span must not end before it begins");
    }
    Trace::process().span(name, kind, at(begin_seconds), at(end_seconds));
  });
}

meshrun_error* meshrun_trace_write(meshrun_runtime* runtime, const char* output_dir) {
  return guarded(__func__, [&] {
    meshrun::host_api::live(runtime, "runtime");
    require(output_dir, "output_dir");
    Trace& trace = Trace::process();
    if (!trace.on()) {
      throw meshrun::Error(MESHRUN_FAILED_PRECONDITION,
                           "meshrun_trace_write without meshrun_trace_start");
    }
    const nlohmann::json gathered = trace.gather(runtime->runtime.job()->host_world());
    if (gathered.is_null()) return;
    std::filesystem::create_directories(output_dir);
    meshrun::write_text_file((std::filesystem::path(output_dir) / "trace.json").string(),
                             gathered.dump() + "\n");
  });
}
