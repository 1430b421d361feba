// distributed.tp_plan (FSDP2Config's key, docs/plan.md "tp_plan"): which of
// the blocks a model computes over tensor-parallel ranks (its description's
// "tp_blocks") are parallel and which are replicated whole, from a named
// plan or a file giving a torch style per module.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "model/model.hpp"

namespace meshrun {

// Every parameter's placement over tp (in description order) and the
// module rules `meshrun plan` prints: {"module": pattern, "style":
// "colwise" | "rowwise" | "replicate"} per module of every block.
struct TensorParallelChoice {
  std::vector<std::string> placements;
  nlohmann::ordered_json rules;
};

// The choice distributed.tp_plan makes for a model planned over tp > 1
// ranks:
//   "" or "default"  every block parallel, as the model computes it
//   "layers"         the blocks inside the decoder layers parallel, the
//                    root's (embedding, lm_head) replicated: for a
//                    vocabulary tp does not divide
//   a .toml file     "module pattern" = "colwise" | "rowwise" | "replicate";
//                    modules it does not name are replicated, as torch's
//                    parallelize_module leaves them
// Throws Error (INVALID_ARGUMENT, key distributed.tp_plan) naming the file
// line, the module and the valid styles for a plan the model cannot
// compute: an unknown style or module, a style other than the model's or
// "replicate", or a block given both.
TensorParallelChoice choose_tensor_parallel(const Config& config, const ModelDescription& d);

}  // namespace meshrun
