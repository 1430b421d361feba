// What the fsdp2 tests (tests/strategy, tests/gpu) share: the row type of
// their synthetic models' parameter tables, and the [distributed] options
// the host sends.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace meshrun::test {

// A parameter of a synthetic model: rows x columns elements in `unit`.
struct Parameter {
  const char* name;
  int64_t rows;
  int64_t columns;
  int32_t unit;
};

// The options with float32 gathers, so that views compare exactly;
// `changes` are merged in (RFC 7386: null removes a key).
inline std::string fsdp2_options_with(const nlohmann::json& changes = nlohmann::json::object()) {
  nlohmann::json options = {{"strategy", "fsdp2"},
                            {"pp_size", 1},
                            {"dp_replicate_size", 1},
                            {"reshard_after_forward", nullptr},
                            {"defer_fsdp_grad_sync", true},
                            {"enable_fsdp2_prefetch", true},
                            {"fsdp2_forward_prefetch_depth", 1},
                            {"fsdp2_backward_prefetch_depth", 2},
                            {"mp_policy",
                             {{"param_dtype", "float32"},
                              {"reduce_dtype", "float32"},
                              {"output_dtype", "float32"},
                              {"cast_forward_inputs", true}}}};
  options.merge_patch(changes);
  return options.dump();
}

}  // namespace meshrun::test
