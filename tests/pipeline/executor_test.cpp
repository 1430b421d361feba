// Multi-process test of the pipeline executor (trainer/pipeline/executor.hpp),
// run by ctest under mpirun on the mpi comm backend:
//
//   mpirun -np 4 meshrun-pipeline-executor-test
//
// Every stage is y = w_s * x elementwise; the first stage reads a
// microbatch's data, the last one's loss is the sum of its outputs, and its
// loss gradient is scaled by 1 / microbatches (the stage's business, not the
// executor's). So every activation, gradient and weight gradient is known in
// closed form: each rank computes the whole pipeline sequentially and checks
// what its stages saw and accumulated against it, for every schedule that
// fits the rank count, over two steps. Then: no buffer is left after a step,
// and a schedule this rank cannot run, an error in a stage, an activation
// nobody consumes and a transfer that fails are reported naming the rank,
// step and action. Rank 0 prints one line per section; a failing rank
// prints what failed. Exits 0 when every rank passed.
//
// Tolerance: none. Weights are in {0.5, 1, 1.5, 2} and data in 1..8, so
// every product along at most 8 stages, and every sum of at most 16 of
// them, is exact in float32, whatever order a schedule adds them in.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "checker.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "pipeline/executor.hpp"
#include "plugin/loader.hpp"
#include "schedule/schedule.hpp"

namespace {

using meshrun::Communicator;
using meshrun::pipeline::Executor;
using meshrun::pipeline::HeldStage;
using meshrun::pipeline::StageWork;
using meshrun::schedule::Action;
using meshrun::schedule::ActionType;
using meshrun::schedule::Schedule;
using meshrun::test::Checker;
using Vector = std::vector<float>;

constexpr int64_t kNumel = 16;

float weight(int64_t stage, int64_t i) { return 0.5f * static_cast<float>(1 + (stage + i) % 4); }

Vector data(int32_t microbatch) {
  Vector x(kNumel);
  for (int64_t i = 0; i < kNumel; ++i) x[i] = static_cast<float>(1 + (microbatch + 2 * i) % 8);
  return x;
}

// What the sequential pipeline computes: per stage and microbatch the input
// and the output gradient, per microbatch the loss, per stage the weight
// gradient of one step.
struct Reference {
  std::vector<std::vector<Vector>> inputs;
  std::vector<std::vector<Vector>> grads;
  std::vector<float> losses;
  std::vector<Vector> weight_grads;
};

Reference sequential(int64_t stages, int32_t microbatches, float loss_scale) {
  Reference ref;
  ref.inputs.assign(stages, std::vector<Vector>(microbatches));
  ref.grads.assign(stages, std::vector<Vector>(microbatches));
  ref.weight_grads.assign(stages, Vector(kNumel, 0.0f));
  for (int32_t m = 0; m < microbatches; ++m) {
    Vector x = data(m);
    for (int64_t s = 0; s < stages; ++s) {
      ref.inputs[s][m] = x;
      for (int64_t i = 0; i < kNumel; ++i) x[i] *= weight(s, i);
    }
    float loss = 0;
    for (float y : x) loss += y;
    ref.losses.push_back(loss);
    Vector dy(kNumel, loss_scale);
    for (int64_t s = stages - 1; s >= 0; --s) {
      ref.grads[s][m] = dy;
      for (int64_t i = 0; i < kNumel; ++i) {
        ref.weight_grads[s][i] += dy[i] * ref.inputs[s][m][i];
        dy[i] *= weight(s, i);
      }
    }
  }
  return ref;
}

// y = w * x. Records every input and output gradient it sees (once per
// microbatch and step) and accumulates dw += dy * x in W.
class ScaleStage : public StageWork {
 public:
  ScaleStage(int64_t stage, int64_t stages, float loss_scale)
      : weight_grad(kNumel, 0.0f), stage_(stage), stages_(stages), loss_scale_(loss_scale) {}

  int64_t input_numel() const override { return first() ? 0 : kNumel; }
  int64_t output_numel() const override { return last() ? 0 : kNumel; }

  void forward(int32_t microbatch, const float* input, float* output) override {
    const Vector x = first() ? data(microbatch) : Vector(input, input + kNumel);
    record(inputs, microbatch, x, "F");
    float loss = 0;
    for (int64_t i = 0; i < kNumel; ++i) {
      const float y = weight(stage_, i) * x[i];
      if (last()) loss += y;
      if (!last()) output[i] = y;
    }
    if (last()) losses[microbatch] = loss;
  }
  void backward(int32_t microbatch, const float* grad_output, float* grad_input) override {
    backward_input(microbatch, grad_output, grad_input);
    backward_weight(microbatch);
  }
  // The last stage seeds the backward with its scaled loss gradient.
  void backward_input(int32_t microbatch, const float* grad_output, float* grad_input) override {
    const Vector dy =
        last() ? Vector(kNumel, loss_scale_) : Vector(grad_output, grad_output + kNumel);
    record(grads, microbatch, dy, "I");
    if (!first()) {
      for (int64_t i = 0; i < kNumel; ++i) grad_input[i] = weight(stage_, i) * dy[i];
    }
  }
  void backward_weight(int32_t microbatch) override {
    if (!inputs.contains(microbatch) || !grads.contains(microbatch) ||
        !weighted.insert(microbatch).second) {
      faults.push_back("W of microbatch " + std::to_string(microbatch) +
                       " without F and I, or twice");
      return;
    }
    for (int64_t i = 0; i < kNumel; ++i)
      weight_grad[i] += grads[microbatch][i] * inputs[microbatch][i];
  }

  void begin_step() {
    inputs.clear();
    grads.clear();
    losses.clear();
    weighted.clear();
  }

  std::map<int32_t, Vector> inputs;
  std::map<int32_t, Vector> grads;
  std::map<int32_t, float> losses;
  std::set<int32_t> weighted;
  std::vector<std::string> faults;
  Vector weight_grad;

 private:
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  void record(std::map<int32_t, Vector>& seen, int32_t microbatch, const Vector& value,
              const char* action) {
    if (!seen.emplace(microbatch, value).second) {
      faults.push_back(std::string(action) + " of microbatch " + std::to_string(microbatch) +
                       " twice");
    }
  }

  int64_t stage_;
  int64_t stages_;
  float loss_scale_;
};

// Calls a sharded strategy's hooks would get, in order.
class RecordingSharding : public meshrun::pipeline::StageSharding {
 public:
  RecordingSharding(int64_t stage, std::vector<std::string>& log) : stage_(stage), log_(log) {}
  void unshard() override { log_.push_back(std::to_string(stage_) + " unshard"); }
  void reshard() override { log_.push_back(std::to_string(stage_) + " reshard"); }
  void reduce_grad() override { log_.push_back(std::to_string(stage_) + " reduce_grad"); }

 private:
  int64_t stage_;
  std::vector<std::string>& log_;
};

// A stage whose forward fails, as a model's might.
class FailingStage : public ScaleStage {
 public:
  using ScaleStage::ScaleStage;
  void forward(int32_t, const float*, float*) override {
    throw meshrun::Error(MESHRUN_INTERNAL, "the stage's forward failed");
  }
};

struct Context {
  Communicator& world;
  const meshrun::PluginLoader& loader;
  Checker& checker;
  int64_t rank() const { return world.rank(); }
  void section(const std::string& name) const {
    if (rank() == 0) std::printf("pipeline executor test: %s\n", name.c_str());
  }
};

// A schedule written out action by action, e.g. {{"0F0", "1F0", "1B0", "0B0"}}.
Schedule written(std::vector<int64_t> stage_rank, int64_t microbatches,
                 const std::vector<std::vector<std::string>>& rows) {
  Schedule schedule;
  schedule.name = "written";
  schedule.pp = static_cast<int64_t>(rows.size());
  schedule.stages_per_rank = static_cast<int64_t>(stage_rank.size()) / schedule.pp;
  schedule.microbatches = microbatches;
  schedule.stage_rank = std::move(stage_rank);
  for (const auto& row : rows) {
    auto& actions = schedule.ranks.emplace_back();
    for (const auto& text : row) {
      const auto action = meshrun::schedule::parse_action(text);
      if (!action) throw std::logic_error("not an action: " + text);
      actions.push_back(*action);
    }
  }
  return schedule;
}

// The stages `schedule` places on `rank`, and their HeldStage entries.
struct Stages {
  Stages(const Schedule& schedule, int64_t rank) {
    const float loss_scale = 1.0f / static_cast<float>(schedule.microbatches);
    for (int64_t s = 0; s < schedule.stages(); ++s) {
      if (schedule.stage_rank[s] != rank) continue;
      owned[s] = std::make_unique<ScaleStage>(s, schedule.stages(), loss_scale);
      held.emplace(s, HeldStage{*owned[s]});
    }
  }
  std::map<int64_t, std::unique_ptr<ScaleStage>> owned;
  std::map<int64_t, HeldStage> held;
};

bool equal(const std::map<int32_t, Vector>& seen, const std::vector<Vector>& expected) {
  if (seen.size() != expected.size()) return false;
  for (const auto& [microbatch, value] : seen) {
    if (value != expected[microbatch]) return false;
  }
  return true;
}

// What stage `s` saw and accumulated after `steps` steps, against the
// sequential pipeline.
void check_stage(Context& c, const std::string& what, int64_t s, const ScaleStage& stage,
                 const Reference& ref, int steps) {
  const std::string where = what + ", stage " + std::to_string(s) + ": ";
  for (const auto& fault : stage.faults) c.checker.check(false, where + fault);
  c.checker.check(equal(stage.inputs, ref.inputs[s]), where + "inputs differ from sequential");
  c.checker.check(equal(stage.grads, ref.grads[s]), where + "gradients differ from sequential");
  c.checker.check(stage.weighted.size() == ref.losses.size(), where + "W missing for a microbatch");
  Vector expected = ref.weight_grads[s];
  for (float& value : expected) value *= static_cast<float>(steps);
  c.checker.check(
      stage.weight_grad == expected,
      where + "weight gradients differ from sequential after " + std::to_string(steps) + " steps");
  if (s + 1 != static_cast<int64_t>(ref.inputs.size())) return;
  bool losses = stage.losses.size() == ref.losses.size();
  for (const auto& [microbatch, loss] : stage.losses)
    losses = losses && loss == ref.losses[microbatch];
  c.checker.check(losses, where + "losses differ from sequential");
}

// Runs `schedule` for two steps on `comm` and checks every stage of this
// rank, and that no buffer outlives a step. Returns the most buffers held.
int64_t check_run(Context& c, Communicator& comm, const Schedule& schedule,
                  const std::string& what) {
  const Reference ref = sequential(schedule.stages(), static_cast<int32_t>(schedule.microbatches),
                                   1.0f / static_cast<float>(schedule.microbatches));
  Stages stages(schedule, comm.rank());
  Executor executor(schedule, comm.rank(), comm, stages.held);
  for (int step = 1; step <= 2; ++step) {
    for (auto& [s, stage] : stages.owned) stage->begin_step();
    executor.run_step();
    for (const auto& [s, stage] : stages.owned) check_stage(c, what, s, *stage, ref, step);
    c.checker.check(
        executor.live_buffers() == 0,
        what + ": " + std::to_string(executor.live_buffers()) + " buffers held after the step");
    c.checker.check(executor.peak_buffers() > 0, what + ": no buffer was used");
    c.checker.check(executor.peak_buffer_bytes() ==
                        executor.peak_buffers() * kNumel * static_cast<int64_t>(sizeof(float)),
                    what + ": peak bytes are not the peak buffers' bytes");
  }
  return executor.peak_buffers();
}

const std::vector<std::string> kShippedSchedules = {
    "gpipe",           "1f1b",     "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
    "zbv_zero_bubble", "dualpipev"};

// The lowered schedule plugin `name` generates for every rank of `comm`,
// with its default stages per rank; nullopt (and a line from rank 0) when
// the sizes do not fit it.
std::optional<Schedule> shipped(Context& c, const std::string& name, int64_t pp,
                                int64_t microbatches) {
  const auto plugin = c.loader.load(meshrun::PluginKind::schedule, name);
  try {
    return meshrun::schedule::lower(meshrun::schedule::generate(
        *plugin, pp, plugin->api().schedule->stages_per_rank, microbatches));
  } catch (const meshrun::Error& e) {
    if (e.code() != MESHRUN_INVALID_ARGUMENT) throw;
    if (c.rank() == 0) std::printf("  %s does not fit: %s\n", name.c_str(), e.what());
    return std::nullopt;
  }
}

// With FSDP2's actions added, every stage is unsharded before its first
// compute, its gradients reduced once, and resharded last.
void check_sharding_hooks(Context& c, const Schedule& lowered, const std::string& what) {
  const Schedule sharded = meshrun::schedule::add_sharding_actions(lowered);
  Stages stages(sharded, c.rank());
  std::map<int64_t, std::vector<std::string>> logs;
  std::vector<std::unique_ptr<RecordingSharding>> hooks;
  for (auto& [s, held] : stages.held) {
    hooks.push_back(std::make_unique<RecordingSharding>(s, logs[s]));
    held.sharding = hooks.back().get();
  }
  Executor(sharded, c.rank(), c.world, stages.held).run_step();
  for (const auto& [s, log] : logs) {
    const std::string id = std::to_string(s);
    c.checker.check(
        log == std::vector<std::string>{id + " unshard", id + " reduce_grad", id + " reshard"},
        what + ", stage " + id + ": sharding hooks out of order");
  }
}

// Every shipped schedule that fits pp = the world size and 8 microbatches,
// against the sequential pipeline.
void shipped_schedules(Context& c) {
  const int64_t microbatches = 8;
  c.section(fmt::format("every shipped schedule, pp = {}, {} microbatches, against sequential",
                        c.world.size(), microbatches));
  for (const std::string& name : kShippedSchedules) {
    const std::optional<Schedule> lowered = shipped(c, name, c.world.size(), microbatches);
    if (!lowered) continue;
    const int64_t peak = check_run(c, c.world, *lowered, name);
    if (c.rank() == 0) {
      std::printf("  %s: %zu actions on rank 0, at most %lld buffers held\n", name.c_str(),
                  lowered->ranks[0].size(), static_cast<long long>(peak));
    }
    check_sharding_hooks(c, *lowered, name + " with sharding actions");
  }
}

// Two stages on one rank (a communicator of its own): activations pass in
// place, the sharding hooks run when the schedule says, and a schedule or a
// stage that goes wrong is named.
void local_stages(Context& c, Communicator& alone) {
  c.section("two stages on one rank: in-place hand-over, sharding hooks, errors named");
  const Schedule two =
      written({0, 0}, 2,
              {{"0UNSHARD", "1UNSHARD", "0F0", "1F0", "0F1", "1F1", "1B0", "0I0", "1B1", "0I1",
                "0W0", "0W1", "1RESHARD", "0RESHARD", "1REDUCE_GRAD", "0REDUCE_GRAD"}});
  check_run(c, alone, two, "two local stages without sharding hooks");

  std::vector<std::string> log;
  RecordingSharding first(0, log);
  RecordingSharding second(1, log);
  Stages hooked(two, 0);
  hooked.held.at(0).sharding = &first;
  hooked.held.at(1).sharding = &second;
  Executor(two, 0, alone, hooked.held).run_step();
  const std::vector<std::string> expected = {"0 unshard", "1 unshard",     "1 reshard",
                                             "0 reshard", "1 reduce_grad", "0 reduce_grad"};
  c.checker.check(log == expected, "sharding hooks not called in the schedule's order");

  Stages missing(two, 0);
  missing.held.erase(1);
  c.checker.expect_error(
      "a stage the rank does not hold", MESHRUN_INVALID_ARGUMENT,
      {"pipeline rank 0 step 1 (1UNSHARD)", "stage 1 is not held by this rank (it holds stages 0)"},
      [&] { Executor(two, 0, alone, missing.held); });
  const Schedule local_send =
      written({0, 0}, 1, {{"0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "0B0"}});
  Stages for_send(local_send, 0);
  c.checker.expect_error("a transfer between two stages of the rank", MESHRUN_INVALID_ARGUMENT,
                         {"pipeline rank 0 step 1 (0SEND_F0)", "both on this rank"},
                         [&] { Executor(local_send, 0, alone, for_send.held); });

  const Schedule unconsumed = written({0, 0}, 1, {{"0F0"}});
  Stages for_unconsumed(unconsumed, 0);
  Executor leaves(unconsumed, 0, alone, for_unconsumed.held);
  c.checker.expect_error("an activation nobody consumes", MESHRUN_INVALID_ARGUMENT,
                         {"pipeline rank 0", "leaves buffers that no action consumed (1)",
                          "input of stage 1, microbatch 0"},
                         [&] { leaves.run_step(); });
  c.checker.check(leaves.live_buffers() == 0, "buffers held after a step that failed");

  const Schedule early = written({0, 0}, 1, {{"1F0", "0F0", "1B0", "0B0"}});
  Stages for_early(early, 0);
  Executor consumes_early(early, 0, alone, for_early.held);
  c.checker.expect_error("an input consumed before it is produced", MESHRUN_INVALID_ARGUMENT,
                         {"pipeline rank 0 step 0 (1F0)",
                          "input of stage 1, microbatch 0 is consumed before anything produced it"},
                         [&] { consumes_early.run_step(); });

  Stages failing(two, 0);
  FailingStage broken(1, 2, 1.0f);
  failing.held.erase(1);
  failing.held.emplace(1, HeldStage{broken});
  Executor fails(two, 0, alone, failing.held);
  c.checker.expect_error("a stage that fails", MESHRUN_INTERNAL,
                         {"pipeline rank 0 step 3 (1F0)", "the stage's forward failed"},
                         [&] { fails.run_step(); });
}

// A second stage that takes half what the first sends.
class NarrowStage : public ScaleStage {
 public:
  using ScaleStage::ScaleStage;
  int64_t input_numel() const override { return kNumel / 2; }
};

// Rank 0 sends its output twice, rank 1 receives it into a buffer too
// small: each error names its action.
void transfer_errors(Context& c, Communicator& pair) {
  c.section("transfers: a buffer sent twice, a failed receive, named by their actions");
  const Schedule schedule =
      written({0, 1}, 1, {{"0F0", "0SEND_F0", "0SEND_F0"}, {"1RECV_F0", "1F0"}});
  if (pair.rank() == 0) {
    ScaleStage first(0, 2, 1.0f);
    Executor executor(schedule, 0, pair, {{0, HeldStage{first}}});
    c.checker.expect_error(
        "a buffer sent twice", MESHRUN_INVALID_ARGUMENT,
        {"pipeline rank 0 step 2 (0SEND_F0)", "the output of stage 0, microbatch 0 is sent twice"},
        [&] { executor.run_step(); });
    return;
  }
  NarrowStage narrow(1, 2, 1.0f);
  Executor executor(schedule, 1, pair, {{1, HeldStage{narrow}}});
  c.checker.expect_error("a receive too small for its message", MESHRUN_INTERNAL,
                         {"pipeline rank 1 step 1 (1F0)",
                          "waiting for the receive of pipeline rank 1 step 0 (1RECV_F0)"},
                         [&] { executor.run_step(); });
}

int run() {
  const auto loader = meshrun::PluginLoader::from_environment();
  meshrun::CommBackend backend(loader, "mpi");
  Communicator world = backend.world(120.0);
  Checker checker(world.rank());
  Context c{world, loader, checker};
  Communicator alone = world.split(world.rank(), 0, "alone");
  Communicator pair = world.split(world.rank() / 2, world.rank(), "pair");
  shipped_schedules(c);
  local_stages(c, alone);
  if (pair.size() == 2) transfer_errors(c, pair);
  return meshrun::test::verdict(world, checker, "pipeline executor test");
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline executor test: %s\n", e.what());
    return 2;
  }
}
