// Stages of a shipped family (models::TransformerStage<Family>) over storage
// of their own, for the tests of models/: an OwnedStage keeps its
// parameters and gradients in two flat buffers in the stage's parameter
// order, as a replicated host does, binds the stage's views to them and
// passes the unit-boundary calls on to an observer; an OwnedModel is the
// stage of the whole model, one microbatch at a time. A Chain runs stages
// covering a model as a pipeline does; RecordingHooks records the calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/stage.hpp"
#include "meshrun/dtype.hpp"

namespace stage_fixture {

using meshrun::models::ParameterView;
using meshrun::models::StageHooks;
using meshrun::models::StageLayout;

template <class Family>
class OwnedStage : public StageHooks {
 public:
  using Config = typename Family::Config;
  using Stage = meshrun::models::TransformerStage<Family>;

  OwnedStage(const Config& config, const StageLayout& layout,
             const meshrun::models::Checkpointing& checkpointing = {},
             bool bfloat16_activations = false)
      : stage_(std::make_unique<Stage>(config, layout, *this, checkpointing, nullptr,
                                       meshrun::models::Placements{},
                                       meshrun::models::ContextParallel{},
                                       meshrun::models::ExpertParallel{}, bfloat16_activations)) {
    views_ = stage_->parameters();
    int64_t total = 0;
    for (const ParameterView& view : views_) total += view.numel;
    params_.assign(size_t(total), 0.0f);
    grads_.assign(size_t(total), 0.0f);
    int64_t offset = 0;
    for (ParameterView& view : views_) {
      view.data = params_.data() + offset;
      view.grad = grads_.data() + offset;
      offset += view.numel;
    }
  }
  OwnedStage(const OwnedStage&) = delete;
  OwnedStage& operator=(const OwnedStage&) = delete;

  Stage& stage() { return *stage_; }
  const Stage& stage() const { return *stage_; }
  const Config& config() const { return stage_->config(); }
  // The stage's parameters, bound to the buffers for good.
  std::vector<ParameterView>& parameters() { return views_; }
  const std::vector<ParameterView>& parameters() const { return views_; }
  float* param_buffer() { return params_.data(); }
  float* grad_buffer() { return grads_.data(); }
  int64_t num_parameters() const { return int64_t(params_.size()); }
  void zero_grad() { std::fill(grads_.begin(), grads_.end(), 0.0f); }
  // Receives every call but bind; nullptr: none.
  void set_observer(StageHooks* observer) { observer_ = observer; }

  void pre_forward(int64_t unit, float* hidden, int64_t numel) override {
    if (observer_) observer_->pre_forward(unit, hidden, numel);
  }
  void post_forward(int64_t unit, float* hidden, int64_t numel) override {
    if (observer_) observer_->post_forward(unit, hidden, numel);
  }
  void pre_backward(int64_t unit) override {
    if (observer_) observer_->pre_backward(unit);
  }
  void post_backward(int64_t unit) override {
    if (observer_) observer_->post_backward(unit);
  }
  void gradient_ready(int64_t parameter) override {
    if (observer_) observer_->gradient_ready(parameter);
  }
  void bind(ParameterView& view, bool backward) override {
    const ParameterView& owned = owned_view(view.index);
    view.data = owned.data;
    view.grad = backward ? owned.grad : nullptr;
    view.bfloat16 = bfloat16_.empty() ? nullptr : bfloat16_.data() + (owned.data - params_.data());
  }
  // Rounds the parameters to bfloat16 and from now on binds each view to a
  // bfloat16 copy of them too, as a strategy gathering in bfloat16 does.
  void hold_bfloat16_copy() {
    bfloat16_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      bfloat16_[i] = meshrun::float_to_bfloat16(params_[i]);
      params_[i] = meshrun::bfloat16_to_float(bfloat16_[i]);
    }
  }

 private:
  const ParameterView& owned_view(int64_t index) const {
    return *std::find_if(views_.begin(), views_.end(),
                         [&](const ParameterView& view) { return view.index == index; });
  }

  std::unique_ptr<Stage> stage_;
  std::vector<ParameterView> views_;
  std::vector<float> params_, grads_;
  std::vector<uint16_t> bfloat16_;  // hold_bfloat16_copy's, else empty
  StageHooks* observer_ = nullptr;
};

// The whole model; forward and backward of one microbatch at a time, a new
// forward dropping what an earlier one kept.
template <class Family>
class OwnedModel : public OwnedStage<Family> {
 public:
  explicit OwnedModel(const typename Family::Config& config)
      : OwnedStage<Family>(config, {0, Family::num_layers(config), true, true}) {
    init_weights(0);
  }

  void init_weights(uint64_t seed) {
    const auto all = Family::parameters(this->config());
    for (ParameterView& view : this->parameters()) {
      Family::init_parameter(this->config(), all, seed, view.index, view.data);
    }
  }
  float forward(const int32_t* tokens, const int32_t* targets, int64_t batch, int64_t seq_len) {
    if (this->stage().activation_bytes() > 0) this->stage().discard(0);
    this->stage().set_shape(batch, seq_len);
    return float(this->stage().forward(0, tokens, targets, nullptr, nullptr));
  }
  void backward() { this->stage().backward(0, 1.0f, nullptr, nullptr); }
};

struct Batch {
  std::vector<int32_t> tokens, targets;
};

inline Batch random_batch(int64_t vocab, int64_t batch, int64_t seq_len, uint32_t seed) {
  std::mt19937 engine(seed);
  std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
  Batch result{std::vector<int32_t>(batch * seq_len), std::vector<int32_t>(batch * seq_len)};
  for (int32_t& t : result.tokens) t = token(engine);
  for (int32_t& t : result.targets) t = token(engine);
  return result;
}

using Gradients = std::map<std::string, std::vector<float>>;

inline Gradients gradients_of(const std::vector<ParameterView>& views) {
  Gradients gradients;
  for (const ParameterView& view : views) {
    gradients[view.name].assign(view.grad, view.grad + view.numel);
  }
  return gradients;
}

inline const ParameterView& named(const std::vector<ParameterView>& views,
                                  const std::string& name) {
  const auto found = std::find_if(views.begin(), views.end(),
                                  [&](const ParameterView& view) { return view.name == name; });
  REQUIRE(found != views.end());
  return *found;
}

// Stages covering the model, weights copied in by name, run one action at a
// time over all stages as a pipeline would: every stage sees the actions in
// the same order, boundaries carry the hidden states and their gradients.
template <class Family>
class Chain {
 public:
  using Stage = meshrun::models::TransformerStage<Family>;

  // `bfloat16`: the stages keep their activations in bfloat16.
  Chain(const OwnedModel<Family>& model, const std::vector<StageLayout>& layouts, int64_t batch,
        int64_t seq_len, const meshrun::models::Checkpointing& checkpointing = {},
        bool bfloat16 = false) {
    for (const StageLayout& layout : layouts) {
      OwnedStage<Family>& owned = *owned_.emplace_back(
          std::make_unique<OwnedStage<Family>>(model.config(), layout, checkpointing, bfloat16));
      for (ParameterView& view : owned.parameters()) {
        const ParameterView& source = named(model.parameters(), view.name);
        REQUIRE(source.shape == view.shape);
        std::copy_n(source.data, view.numel, view.data);
      }
      owned.stage().set_shape(batch, seq_len);
      stages.push_back(&owned.stage());
    }
    grad_inputs.resize(stages.size());
  }

  float forward(int32_t mb, const Batch& batch) {
    std::vector<float> input, output;
    float loss = 0;
    for (Stage* stage : stages) {
      output.assign(stage->output_numel(), 0.0f);
      loss = float(stage->forward(mb, batch.tokens.data(), batch.targets.data(), input.data(),
                                  output.data()));
      input.swap(output);
    }
    return loss;
  }

  // B, or I alone when `input_only`.
  void backward(int32_t mb, float loss_scale, bool input_only) {
    std::vector<float> grad_output;
    for (size_t s = stages.size(); s-- > 0;) {
      Stage& stage = *stages[s];
      grad_inputs[s].assign(stage.input_numel(), 0.0f);
      if (input_only) {
        stage.backward_input(mb, loss_scale, grad_output.data(), grad_inputs[s].data());
      } else {
        stage.backward(mb, loss_scale, grad_output.data(), grad_inputs[s].data());
      }
      grad_output = grad_inputs[s];
    }
  }

  void backward_weight(int32_t mb) {
    for (Stage* stage : stages) stage->backward_weight(mb);
  }

  Gradients gradients() const {
    Gradients all;
    for (const auto& owned : owned_) all.merge(gradients_of(owned->parameters()));
    return all;
  }
  const OwnedStage<Family>& owned(size_t s) const { return *owned_[s]; }

  int64_t activation_bytes() const {
    int64_t total = 0;
    for (const Stage* stage : stages) total += stage->activation_bytes();
    return total;
  }

  // Runs a schedule such as "F0 F1 B0 I1 W1": F forward, B full backward, I
  // input backward, W weight backward of a microbatch. Returns the losses by
  // microbatch.
  std::map<int32_t, float> run(const std::string& schedule, const std::vector<Batch>& batches,
                               float loss_scale) {
    std::map<int32_t, float> losses;
    std::istringstream actions(schedule);
    std::string action;
    while (actions >> action) {
      const int32_t mb = std::stoi(action.substr(1));
      INFO(action);
      if (action[0] == 'F') losses[mb] = forward(mb, batches.at(mb));
      if (action[0] == 'B' || action[0] == 'I') backward(mb, loss_scale, action[0] == 'I');
      if (action[0] == 'W') backward_weight(mb);
    }
    return losses;
  }

  std::vector<Stage*> stages;
  std::vector<std::vector<float>> grad_inputs;  // of the latest backward, per stage

 private:
  std::vector<std::unique_ptr<OwnedStage<Family>>> owned_;
};

// Activation checkpointing of a 4-layer model: a chain of `layouts` gives
// exactly the losses, gradients and input gradients of one that keeps
// everything, with layers 1-3 fully recomputed, and with full and
// selective layers mixed, for each schedule (Chain::run, loss_scale 1/4),
// as the backward recomputes with the same input, parameters and kernels;
// with activations kept in float32 and in bfloat16 (what is recomputed is
// rounded as keeping it would be). The whole model holds less for a
// microbatch in flight, and less again for the next one, which shares the
// scratch.
template <class Family>
void check_checkpointing_is_exact(const OwnedModel<Family>& model,
                                  const std::vector<StageLayout>& layouts,
                                  const std::vector<Batch>& batches, int64_t batch,
                                  int64_t seq_len) {
  using meshrun::models::Recomputation;
  const meshrun::models::Checkpointing checkpointing = GENERATE(
      meshrun::models::Checkpointing{
          {1, Recomputation::full}, {2, Recomputation::full}, {3, Recomputation::full}},
      meshrun::models::Checkpointing{{0, Recomputation::selective},
                                     {1, Recomputation::full},
                                     {2, Recomputation::selective},
                                     {3, Recomputation::selective}});
  const bool bfloat16 = GENERATE(false, true);
  INFO("bfloat16 activations " << bfloat16);
  for (const std::string schedule :
       {"F0 B0 F1 B1 F2 B2 F3 B3", "F0 F1 I0 F2 I1 W0 F3 I2 W1 W2 B3"}) {
    INFO(schedule);
    Chain<Family> kept(model, layouts, batch, seq_len, {}, bfloat16);
    Chain<Family> recomputing(model, layouts, batch, seq_len, checkpointing, bfloat16);
    CHECK(recomputing.run(schedule, batches, 0.25f) == kept.run(schedule, batches, 0.25f));
    CHECK(recomputing.gradients() == kept.gradients());
    CHECK(recomputing.grad_inputs == kept.grad_inputs);
    CHECK(recomputing.activation_bytes() == 0);
  }
  const std::vector<StageLayout> whole = {{0, Family::num_layers(model.config()), true, true}};
  Chain<Family> kept(model, whole, batch, seq_len, {}, bfloat16);
  Chain<Family> recomputing(model, whole, batch, seq_len, checkpointing, bfloat16);
  kept.run("F0", batches, 1.0f);
  recomputing.run("F0", batches, 1.0f);
  const int64_t kept_one = kept.activation_bytes(), first = recomputing.activation_bytes();
  CHECK(first < kept_one);
  recomputing.run("F1", batches, 1.0f);
  CHECK(recomputing.activation_bytes() - first < first);
}

// A unit as the hooks' text names it: its layer's number, "embedding",
// "head" or "root".
template <class Family>
std::string unit_name(const OwnedModel<Family>& model, int64_t unit) {
  const meshrun::models::DecoderUnits units(Family::num_layers(model.config()));
  if (unit < units.embedding) return std::to_string(unit);
  return unit == units.embedding ? "embedding" : unit == units.head ? "head" : "root";
}

template <class Family>
bool holds_unit(const OwnedModel<Family>& model, int64_t unit) {
  return std::any_of(model.parameters().begin(), model.parameters().end(),
                     [&](const ParameterView& view) { return view.unit == unit; });
}

// The unit-boundary calls as text ("pre_forward 0", "gradient_ready root"),
// with each gradient as it was when announced and each unit's gradients at
// its post_backward.
template <class Family>
class RecordingHooks : public StageHooks {
 public:
  explicit RecordingHooks(const OwnedModel<Family>& model) : model_(model) {}
  void pre_forward(int64_t unit, float*, int64_t) override {
    events.push_back("pre_forward " + name(unit));
  }
  void post_forward(int64_t unit, float*, int64_t) override {
    events.push_back("post_forward " + name(unit));
  }
  void pre_backward(int64_t unit) override { events.push_back("pre_backward " + name(unit)); }
  void post_backward(int64_t unit) override {
    events.push_back("post_backward " + name(unit));
    unit_gradients_when_ready[unit] = unit_gradients(model_, unit);
  }
  void gradient_ready(int64_t parameter) override {
    const ParameterView& view = model_.parameters().at(size_t(parameter));
    events.push_back("gradient_ready " + name(view.unit));
    ready_order.push_back(parameter);
    gradients_when_ready[parameter].assign(view.grad, view.grad + view.numel);
  }
  void bind(ParameterView&, bool) override {}

  // The gradients of a unit's parameters, in parameter order.
  static std::vector<float> unit_gradients(const OwnedModel<Family>& model, int64_t unit) {
    std::vector<float> gradients;
    for (const ParameterView& view : model.parameters()) {
      if (view.unit == unit) gradients.insert(gradients.end(), view.grad, view.grad + view.numel);
    }
    return gradients;
  }

  std::vector<std::string> events;
  std::vector<int64_t> ready_order;
  std::map<int64_t, std::vector<float>> unit_gradients_when_ready, gradients_when_ready;

 private:
  std::string name(int64_t unit) const { return unit_name<Family>(model_, unit); }
  const OwnedModel<Family>& model_;
};

// What model.h documents, checked on the calls of one forward and backward
// of the whole model: the root's hooks enclose the others', the embedding,
// the layers and the head in forward order and then in reverse (a unit
// holding no parameter, a tied model's embedding, has none); every
// parameter is announced once, in reverse order, between its unit's
// pre_backward and post_backward, its gradient final by then.
template <class Family>
void check_documented_order(const RecordingHooks<Family>& hooks, const OwnedModel<Family>& model) {
  const meshrun::models::DecoderUnits units(Family::num_layers(model.config()));
  std::vector<int64_t> forward_order;
  if (holds_unit(model, units.embedding)) forward_order.push_back(units.embedding);
  for (int64_t l = 0; l < units.embedding; ++l) forward_order.push_back(l);
  forward_order.push_back(units.head);
  const auto name = [&](int64_t unit) { return unit_name<Family>(model, unit); };
  std::vector<std::string> expected = {"pre_forward root"};
  for (const int64_t u : forward_order) {
    expected.push_back("pre_forward " + name(u));
    expected.push_back("post_forward " + name(u));
  }
  expected.insert(expected.end(), {"post_forward root", "pre_backward root"});
  for (auto u = forward_order.rbegin(); u != forward_order.rend(); ++u) {
    expected.push_back("pre_backward " + name(*u));
    expected.push_back("post_backward " + name(*u));
  }
  expected.push_back("post_backward root");
  std::vector<std::string> unit_events;
  std::copy_if(hooks.events.begin(), hooks.events.end(), std::back_inserter(unit_events),
               [](const std::string& event) { return event.rfind("gradient_ready", 0) != 0; });
  CHECK(unit_events == expected);

  std::vector<int64_t> reverse_order(model.parameters().size());
  for (size_t i = 0; i < reverse_order.size(); ++i) {
    reverse_order[i] = int64_t(reverse_order.size() - 1 - i);
  }
  CHECK(hooks.ready_order == reverse_order);
  const auto position = [&](const std::string& event) {
    return std::find(hooks.events.begin(), hooks.events.end(), event) - hooks.events.begin();
  };
  for (int64_t i = 0; i < int64_t(hooks.events.size()); ++i) {
    const std::string& event = hooks.events[size_t(i)];
    if (event.rfind("gradient_ready ", 0) != 0) continue;
    const std::string unit = event.substr(std::string("gradient_ready ").size());
    INFO(event << " at " << i);
    CHECK(position("pre_backward " + unit) < i);
    CHECK(i < position("post_backward " + unit));
  }
  for (const auto& [parameter, gradient] : hooks.gradients_when_ready) {
    const ParameterView& view = model.parameters()[size_t(parameter)];
    INFO(view.name);
    CHECK(gradient == std::vector<float>(view.grad, view.grad + view.numel));
  }
  for (int64_t unit = 0; unit <= units.root; ++unit) {
    INFO("unit " << unit);
    if (!holds_unit(model, unit)) continue;
    CHECK(hooks.unit_gradients_when_ready.at(unit) ==
          RecordingHooks<Family>::unit_gradients(model, unit));
  }
}

// What a sharded strategy does: each unit's parameters live in storage
// allocated at the unit's pre-hook and freed at its post-hook, and the
// stage's views point at it in between.
template <class Family>
class UnitStorageHooks : public StageHooks {
 public:
  explicit UnitStorageHooks(const OwnedModel<Family>& owner) : owner_(owner) {}
  void pre_forward(int64_t unit, float*, int64_t) override { materialize(unit); }
  void post_forward(int64_t unit, float*, int64_t) override { storage_.erase(unit); }
  void pre_backward(int64_t unit) override { materialize(unit); }
  void post_backward(int64_t unit) override {
    const Storage& storage = storage_.at(unit);
    grads.insert(grads.end(), storage.grads.begin(), storage.grads.end());
    storage_.erase(unit);
  }
  void gradient_ready(int64_t) override {}
  void bind(ParameterView& view, bool backward) override {
    Storage& storage = storage_.at(view.unit);
    const int64_t at = storage.offset.at(view.index);
    view.data = storage.params.data() + at;
    view.grad = backward ? storage.grads.data() + at : nullptr;
  }

  std::vector<float> grads;  // per unit in post_backward order, parameters in index order

 private:
  struct Storage {
    std::vector<float> params, grads;
    std::map<int64_t, int64_t> offset;
  };
  void materialize(int64_t unit) {
    Storage& storage = storage_[unit];
    for (const ParameterView& view : owner_.parameters()) {
      if (view.unit != unit) continue;
      storage.offset[view.index] = int64_t(storage.params.size());
      storage.params.insert(storage.params.end(), view.data, view.data + view.numel);
    }
    storage.grads.assign(storage.params.size(), 0.0f);
  }
  const OwnedModel<Family>& owner_;
  std::map<int64_t, Storage> storage_;
};

// The model's forward and backward of `batch` again on a stage whose units
// are bound to storage that comes and goes: the same loss and gradients, bit
// for bit.
template <class Family>
void check_unit_storage(OwnedModel<Family>& owning, const Batch& batch, int64_t batch_size,
                        int64_t seq_len) {
  const float expected =
      owning.forward(batch.tokens.data(), batch.targets.data(), batch_size, seq_len);
  owning.backward();

  UnitStorageHooks<Family> hooks(owning);
  const int64_t layers = Family::num_layers(owning.config());
  meshrun::models::TransformerStage<Family> bound(owning.config(), {0, layers, true, true}, hooks);
  bound.set_shape(batch_size, seq_len);
  CHECK(float(bound.forward(0, batch.tokens.data(), batch.targets.data(), nullptr, nullptr)) ==
        expected);
  bound.backward(0, 1.0f, nullptr, nullptr);

  // In post_backward order: the head, the layers last to first, the
  // embedding, the root.
  const meshrun::models::DecoderUnits units(layers);
  std::vector<int64_t> backward_order = {units.head};
  for (int64_t l = layers - 1; l >= 0; --l) backward_order.push_back(l);
  backward_order.insert(backward_order.end(), {units.embedding, units.root});
  std::vector<float> expected_grads;
  for (const int64_t unit : backward_order) {
    const std::vector<float> unit_grads = RecordingHooks<Family>::unit_gradients(owning, unit);
    expected_grads.insert(expected_grads.end(), unit_grads.begin(), unit_grads.end());
  }
  CHECK(hooks.grads == expected_grads);
}

}  // namespace stage_fixture
