// The modules of a shipped family's model (an embedding, a module per
// decoder layer, a head): the description a model plugin returns
// (meshrun/model.h "describe") and the layout of a stage of some of them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/layers.hpp"
#include "common/parameters.hpp"
#include "common/stage.hpp"

namespace meshrun::models {

// A module a pipeline split may cut before or after; modules of one
// non-empty group stay on one stage.
struct ModuleSpec {
  std::string name;
  std::vector<std::string> parameters;
  std::string group;
};

// The embedding's modules (first), then layer l's module layer_prefix + l
// (also its unit's name) holding the parameters of unit l, then the head's
// modules (last).
struct ModelModules {
  std::vector<ModuleSpec> embedding;
  std::string layer_prefix;
  std::vector<ModuleSpec> head;
};

// The description JSON: `fields` (what the family knows: "config",
// "vocab_size", "max_seq_len", "num_layers_key") with "parameters", "units",
// "unit_kinds" and "modules" added from the parameters of a model of
// `num_layers` layers, in DecoderUnits.
std::string describe_model(nlohmann::ordered_json fields,
                           const std::vector<ParameterView>& parameters, int64_t num_layers,
                           const ModelModules& modules);

// The description's "activations" (meshrun/model.h): elements per token,
// {whole, tp_split} pairs; of the layer's, the element-wise part's and the
// head's, those a bfloat16 run keeps in float32 (common/kept_activations.hpp:
// norm statistics, log-sum-exps, the loss's softmax, routing).
struct ActivationsPerToken {
  int64_t layer_whole, layer_split, elementwise_whole, elementwise_split, stream, head_whole,
      head_split;
};
struct Float32PerToken {
  int64_t layer_whole, layer_split, elementwise_whole, elementwise_split, head_whole, head_split;
};
nlohmann::ordered_json activations_json(const ActivationsPerToken& activations,
                                        const Float32PerToken& float32);

// One of the GEMMs a forward runs (the description's flops.gemms): rows x
// k times k x n, on `rows` of a microbatch's rows, `count` times per
// forward; `tp` "k" or "n" for the dimension split over tp ranks, or empty.
struct GemmShape {
  int64_t k, n, count;
  double rows;
  const char* tp;
};

// The description's "flops" (meshrun/model.h): the weights a token meets in
// matmuls, the attention layers with their query width (heads x head_dim),
// and the GEMMs the forward runs (none: not described).
nlohmann::ordered_json flops_json(int64_t matmul_parameters, int64_t attention_layers,
                                  int64_t attention_width,
                                  const std::vector<GemmShape>& gemms = {});

// The description's "tp_blocks" (meshrun/model.h): each block's name and
// its modules' styles.
nlohmann::ordered_json tp_blocks_json(const std::vector<BlockSpec>& specs);

// The layout of a stage computing the modules `names` (a contiguous run of
// the model's, which the host checked). Throws std::invalid_argument
// starting with `family` for an unknown module, and for some but not all
// modules of the embedding or of the head.
StageLayout stage_layout(const ModelModules& modules, int64_t num_layers,
                         const std::vector<std::string>& names, const char* family);

// The checkpointed layers: the plan's "activation_checkpointing" entries
// (docs/plan.md), each naming a layer's module and its mode, "full" or
// "selective". A null or empty plan checkpoints nothing. Throws
// std::invalid_argument starting with `family` for a plan that is not JSON,
// a module that is not a layer, and another mode.
Checkpointing checkpointed_layers(const ModelModules& modules, int64_t num_layers,
                                  const char* plan_json, const char* family);

// What the stage's matmuls compute in: the plan's "autocast_dtype"
// (docs/plan.md), null or absent for float32, "bfloat16" for autocast's
// bfloat16 matmuls. Throws std::invalid_argument starting with `family`
// for another dtype.
kernels::MatmulPrecision planned_matmul_precision(const char* plan_json, const char* family);

}  // namespace meshrun::models
