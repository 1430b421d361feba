// The trainer's side of the module hooks (llama::ModuleHooks).
//
// Replicated strategies (ddp): as soon as backward has made a parameter's
// gradient final (gradient_ready, last parameter first), the strategy is told
// its element range, so DDP starts reducing a bucket the moment its last
// gradient is done, while backward goes on.
//
// Sharded strategies (fsdp2): around each unit's forward and backward the
// strategy gathers and frees the unit's parameters, and the hooks point the
// model's parameter views at the gathered storage; they also apply the
// mixed-precision policy's casts to the hidden states entering and leaving
// each decoder layer.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "llama/model.hpp"
#include "strategy/strategy.hpp"

namespace meshrun::train {

using ElementRange = std::pair<int64_t, int64_t>;  // [begin, end) of the flat buffers

// Each parameter's range in the flat buffers, in parameters() order.
std::vector<ElementRange> parameter_ranges(const llama::LlamaModel& model);

class StrategyHooks : public llama::ModuleHooks {
 public:
  StrategyHooks(Strategy& strategy, const llama::LlamaModel& model)
      : strategy_(strategy), ranges_(parameter_ranges(model)) {}

  void gradient_ready(int parameter) override;

  // Seconds spent inside the strategy's hook calls since the last call:
  // communication the strategy could not hide, plus its copies.
  double take_seconds_in_strategy();

 protected:
  // Runs `call` (a call into the strategy), adding its duration.
  template <class Call>
  void timed(Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    seconds_in_strategy_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  Strategy& strategy_;
  std::vector<ElementRange> ranges_;
  double seconds_in_strategy_ = 0;
};

// The sidecar plan's units ("units": [{"name", "parameters": [names]}]) as
// the strategy ABI numbers them: decoder layer l is unit l, the root (the
// unit named "root") is unit num_hidden_layers. Throws INVALID_ARGUMENT when
// the plan's units are not the model's layers and root, naming the unit.
StrategyUnits model_units(const nlohmann::ordered_json& plan_units, const llama::LlamaModel& model);

// Points the views of a sharded strategy's unit (`parameters`: indices into
// `views`, in index order) at the strategy's gathered storage, and at its
// gradient buffer when `gradients`, else nowhere.
void bind_unit(Strategy& strategy, int32_t unit, const std::vector<int>& parameters,
               std::vector<llama::ParameterView>& views, bool gradients);

class ShardedHooks : public StrategyHooks {
 public:
  ShardedHooks(Strategy& strategy, llama::LlamaModel& model, const StrategyUnits& units,
               const MixedPrecisionConfig& precision);

  void pre_forward(int unit) override;
  void post_forward(int unit) override;
  void pre_backward(int unit) override;
  void post_backward(int unit) override;

 private:
  int32_t strategy_unit(int unit) const { return unit == llama::kRootUnit ? root_unit_ : unit; }
  // Points the unit's parameter views (and gradient views) at the strategy's storage.
  void bind(int32_t unit, bool gradients);
  void round_hidden_states(int64_t layer, const std::string& dtype);

  Strategy& strategy_;
  llama::LlamaModel& model_;
  int32_t root_unit_;
  std::vector<std::vector<int>> unit_parameters_;
  MixedPrecisionConfig precision_;
};

}  // namespace meshrun::train
