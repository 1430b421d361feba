#include "common/errors.hpp"

namespace meshrun::strategies {

void invalid(const std::string& message) { throw Error(MESHRUN_INVALID_ARGUMENT, message); }

void out_of_order(const std::string& message) { throw Error(MESHRUN_FAILED_PRECONDITION, message); }

void throw_if_error(meshrun_error* error, const std::string& context) {
  if (error == nullptr) return;
  const int32_t code = error->code;
  const std::string message = error->message != nullptr ? error->message : "(no message)";
  meshrun_error_release(error);
  throw Error(code, context + ": " + message);
}

void write_memory(meshrun_strategy_memory* out, int64_t buffers, int64_t peak, int64_t reserved) {
  if (out == nullptr) invalid("memory: out is NULL");
  if (!MESHRUN_HAS_FIELD(meshrun_strategy_memory, out, buffers)) {
    invalid("memory: out->struct_size " + std::to_string(out->struct_size) + " is too small");
  }
  out->buffers = buffers;
  if (MESHRUN_HAS_FIELD(meshrun_strategy_memory, out, buffers_peak)) out->buffers_peak = peak;
  if (MESHRUN_HAS_FIELD(meshrun_strategy_memory, out, buffers_reserved)) {
    out->buffers_reserved = reserved;
  }
}

void write_memory_plan(meshrun_strategy_memory_plan* out, int64_t local_numel,
                       int64_t buffers_held) {
  if (out == nullptr) invalid("plan_memory: out is NULL");
  if (!MESHRUN_HAS_FIELD(meshrun_strategy_memory_plan, out, buffers_held)) {
    invalid("plan_memory: out->struct_size " + std::to_string(out->struct_size) + " is too small");
  }
  out->local_numel = local_numel;
  out->buffers_held = buffers_held;
}

}  // namespace meshrun::strategies
