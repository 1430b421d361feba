// The trainer's side of a model stage's unit-boundary calls (StageHooks).
//
// Replicated strategies (ddp): the parameters live in the trainer's flat
// buffers; as soon as backward has made a parameter's gradient final
// (gradient_ready) the strategy is told its element range, so DDP starts
// reducing a bucket the moment its last gradient is done, while backward
// goes on.
//
// Sharded strategies (fsdp2): around each unit's forward and backward the
// strategy gathers and frees the unit's parameters, and the model is handed
// views of the gathered storage; the hooks also apply the mixed-precision
// policy's casts to the hidden states entering and leaving each layer unit.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"
#include "model/model.hpp"
#include "state/local_parameters.hpp"
#include "strategy/strategy.hpp"
#include "trace/trace.hpp"

namespace meshrun::train {

// The strategy's units for a stage (strategy_unit_numbers) and each
// parameter's unit by that numbering.
struct StageUnits {
  StrategyUnits strategy;
  std::vector<int32_t> of_model_unit;   // strategy unit of each description unit, or -1
  std::vector<int64_t> offset_in_unit;  // per stage parameter, in the unit's flat view
};
StageUnits stage_units(const ModelDescription& description, const StageContents& contents);

// Seconds spent inside strategy calls made from hooks.
class TimedHooks : public StageHooks {
 public:
  // Seconds since the last call: communication the strategy could not hide,
  // plus its copies.
  double take_seconds_in_strategy() { return std::exchange(seconds_in_strategy_, 0.0); }

 protected:
  // Runs the strategy's `call` for `hook` of `unit`, timed and traced.
  template <class Call>
  void timed(const char* hook, int32_t unit, Call&& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const auto end = std::chrono::steady_clock::now();
    seconds_in_strategy_ += std::chrono::duration<double>(end - start).count();
    trace::Trace& trace = trace::Trace::process();
    if (trace.on())
      trace.span(fmt::format("strategy {} {}", hook, unit), trace::kCommSpan, start, end);
  }

 private:
  double seconds_in_strategy_ = 0;
};

class ReplicatedHooks : public TimedHooks {
 public:
  ReplicatedHooks(Strategy& strategy, FlatParameters& parameters)
      : strategy_(strategy), parameters_(parameters) {}

  void gradient_ready(int64_t parameter) override;
  ParameterStorage parameter(int64_t parameter, bool backward) override;

 private:
  Strategy& strategy_;
  FlatParameters& parameters_;
};

// A sharded strategy's units bound to the model: each unit's gathered views
// while it is unsharded, and every parameter's place in them.
class UnitBinding {
 public:
  UnitBinding(Strategy& strategy, const StageUnits& units, const std::vector<int64_t>& parameters,
              size_t description_parameters);
  // Takes the unit's views from the strategy (unit_views, and
  // unit_views_bfloat16 when it gathers in bfloat16).
  void bind(int32_t strategy_unit);
  ParameterStorage storage(int64_t parameter, bool backward) const;
  const StageUnits& units() const { return units_; }

 private:
  struct Views {
    FloatView parameters;
    FloatView gradients;
    Bfloat16View bfloat16;
  };
  Strategy& strategy_;
  const StageUnits& units_;
  std::vector<Views> views_;             // per strategy unit
  std::vector<int64_t> stage_position_;  // per description parameter
};

// A sharded strategy over some of a stage's parameters (description
// indices): a mixture of experts has two, its dense parameters' and its
// experts'.
struct StrategyPart {
  Strategy& strategy;
  const StageUnits& units;
  const std::vector<int64_t>& parameters;
};

// Several sharded strategies' units bound to one stage, and which of them
// holds each parameter.
class PartBindings {
 public:
  struct Bound {
    Bound(const StrategyPart& part, size_t description_parameters)
        : strategy(part.strategy),
          binding(part.strategy, part.units, part.parameters, description_parameters) {}
    Strategy& strategy;
    UnitBinding binding;
  };

  PartBindings(const std::vector<StrategyPart>& parts, size_t description_parameters);
  std::vector<std::unique_ptr<Bound>>& parts() { return parts_; }
  // OUT_OF_RANGE for a parameter no part holds (another ep rank's expert).
  ParameterStorage storage(int64_t parameter, bool backward) const;

 private:
  std::vector<std::unique_ptr<Bound>> parts_;
  std::vector<int32_t> part_of_;  // per description parameter, or -1
};

// Sharded strategies around the units: each strategy holding some of a
// unit's parameters gathers and frees them, in the parts' order, the same
// on every rank.
class ShardedHooks : public TimedHooks {
 public:
  // The hidden states the stage shows the hooks are `state`'s memory (the
  // stage computes where the trainer's state is), which rounds them.
  ShardedHooks(const std::vector<StrategyPart>& parts, size_t description_parameters,
               const MixedPrecisionConfig& precision, StateDevice& state);

  void pre_forward(int32_t unit, float* hidden, int64_t numel) override;
  void post_forward(int32_t unit, float* hidden, int64_t numel) override;
  void pre_backward(int32_t unit) override;
  void post_backward(int32_t unit) override;
  ParameterStorage parameter(int64_t parameter, bool backward) override;

 private:
  // Calls `call(strategy, strategy unit)` for each part holding parameters
  // of description unit `unit`, then binds its views when `bind`.
  template <class Call>
  void each_part(const char* hook, int32_t unit, bool bind, Call&& call);

  PartBindings bindings_;
  MixedPrecisionConfig precision_;
  StateDevice& state_;
};

}  // namespace meshrun::train
