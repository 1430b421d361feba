// Errors of strategy plugins: what they throw inside, and how it becomes a
// meshrun_error at the ABI boundary, named after the strategy.
#pragma once

#include <cstdint>
#include <string>

#include "meshrun/plugin.hpp"
#include "meshrun/strategy.h"

namespace meshrun::strategies {

using meshrun::plugin::Error;

// INVALID_ARGUMENT: bad setup, options or arguments.
[[noreturn]] void invalid(const std::string& message);
// FAILED_PRECONDITION: a call out of the lifecycle's order.
[[noreturn]] void out_of_order(const std::string& message);

// Throws the comm backend's error with `context`, releasing it through its
// own destroy (the backend made it). Does nothing for NULL.
void throw_if_error(meshrun_error* error, const std::string& context);

// Writes the strategy's memory into *out, `peak` and `reserved` only where
// the caller's struct (ABI 1.3) has room for them.
void write_memory(meshrun_strategy_memory* out, int64_t buffers, int64_t peak, int64_t reserved);
// Fills `out` (plan_memory's), checking its struct_size.
void write_memory_plan(meshrun_strategy_memory_plan* out, int64_t local_numel,
                       int64_t buffers_held);

// Runs `body` and turns whatever it throws into an error whose message
// begins with "<strategy>: ", so that every message names the strategy
// without each throw having to.
template <class Body>
meshrun_error* guard(const char* strategy, Body&& body) noexcept {
  return meshrun::plugin::guard([&] {
    try {
      body();
    } catch (const Error& e) {
      throw Error(e.code(), std::string(strategy) + ": " + e.what());
    }
  });
}

// guard() for an entry point of a plugin whose instances are T objects.
template <class T, class Body>
meshrun_error* on_instance(const char* strategy, meshrun_plugin_instance* instance,
                           Body&& body) noexcept {
  return guard(strategy, [&] {
    if (instance == nullptr) invalid("instance is NULL");
    body(*reinterpret_cast<T*>(instance));
  });
}

}  // namespace meshrun::strategies
