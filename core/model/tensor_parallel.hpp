// How tensor parallelism places a model's parameters (the plan's "tp" of
// each parameter, docs/plan.md) and what that means for the host: the
// shapes one tp rank holds, which of the full tensor's elements they are,
// and how the ranks' pieces make the full tensor again (initialization,
// model.checkpoint, sharded checkpoints and the consolidated export all
// speak full tensors, so any layout reads what any other wrote).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.hpp"

namespace meshrun {

// One parameter's placement over tp. Sharded: dimension `dim` is `blocks`
// equal blocks (GPT-2's fused c_attn holds q, k and v side by side: 3), and
// tp rank r holds piece r of tp equal pieces of every block; the local
// extent of `dim` is shape[dim] / tp.
struct TensorPlacement {
  int dim = -1;  // -1: replicated, every tp rank holds the whole tensor
  int64_t blocks = 1;
  bool sharded() const { return dim >= 0; }
};

// "replicate", "shard(d)" or "shard(d,blocks)" with d < ndim and blocks >=
// 1; nullopt for anything else.
std::optional<TensorPlacement> parse_tensor_placement(const std::string& text, size_t ndim);

// The module a parameter belongs to: its name without the last component.
std::string module_of(const std::string& parameter);
// Whether `module` is named by `pattern`, where '*' stands for one whole
// name component ("model.layers.*.mlp.up_proj").
bool module_matches(const std::string& pattern, const std::string& module);

class TensorParallelLayout {
 public:
  // The layout of `plan`'s "parameters" over tp ranks. Throws
  // INVALID_ARGUMENT with key "distributed.tp_size" for a placement
  // parse_tensor_placement refuses, or a sharded extent that tp * blocks
  // does not divide, naming the parameter.
  TensorParallelLayout(const ModelDescription& full, const nlohmann::ordered_json& plan,
                       int64_t tp);

  int64_t tp() const { return tp_; }
  // The description with every parameter's shape, numel and offset as one
  // tp rank holds it (the full description when tp is 1).
  const ModelDescription& local() const { return local_; }
  const TensorPlacement& placement(int64_t parameter) const {
    return placements_[size_t(parameter)];
  }
  bool any_sharded() const;
  // Where parameter `parameter` begins in the full model's flat layout, and
  // its full element count.
  int64_t full_offset(int64_t parameter) const { return full_[size_t(parameter)].offset; }
  int64_t full_numel(int64_t parameter) const { return full_[size_t(parameter)].numel; }

  // Tp rank `rank`'s piece of parameter `parameter` (local().numel floats)
  // from its full values.
  void slice(int64_t parameter, int64_t rank, const float* full, float* local) const;
  // The full values from every rank's piece, rank r's at pieces + r * local numel.
  void assemble(int64_t parameter, const float* pieces, float* full) const;
  // Calls run(local_index, full_index, count) for the runs of contiguous
  // elements that local elements [begin, begin + count) of `parameter` on
  // tp rank `rank` are in the full tensor; indices within the parameter.
  void for_each_run(int64_t parameter, int64_t rank, int64_t begin, int64_t count,
                    const std::function<void(int64_t, int64_t, int64_t)>& run) const;

 private:
  // Splits a placement's tensor as [outer, blocks, tp, piece * inner].
  struct Split {
    int64_t outer, blocks, run;  // run: piece * inner contiguous elements
  };
  Split split(int64_t parameter) const;

  int64_t tp_;
  std::vector<TensorPlacement> placements_;
  std::vector<ModelParameter> full_;
  ModelDescription local_;
};

}  // namespace meshrun
