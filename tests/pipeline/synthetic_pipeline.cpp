// A pipeline of synthetic stages of fixed cost, run by the executor for
// several steps; the program tests/bench/pipeline_idle.py runs, one rank
// per pipeline rank:
//
//   meshrun launch --nproc-per-node 4 -- meshrun-synthetic-pipeline
//       --schedule 1f1b [--microbatches 8] [--steps 5] [--cost-ms 10]
//       [--numel 4096] [--clock wall|cpu]
//
// Costs: a rank's share of the model costs `cost-ms` per microbatch
// forward, so a stage (of stages_per_rank on the rank) costs F = T, B = 2T,
// I = W = T with T = cost-ms / stages_per_rank: every schedule does the same
// work per rank. The work is busy: the thread computes until the cost has
// passed on `clock` (wall: the action lasts T of wall time whatever else
// runs on the core, as if the rank had a core of its own; cpu: it lasts
// until the thread has had T of CPU time, so it stretches when ranks share
// a core). Activations of `numel` floats travel between ranks.
//
// Rank 0 prints one JSON object: per rank the measured idle share (1 -
// compute time / step time, where the step time is the slowest rank's
// run_step, averaged over the steps) beside the simulator's for the same
// schedule and costs (computed on the compute-only schedule with free
// communication: the ideal the executor approaches), the step time and the
// throughput. Exits 2 on bad arguments, 1 on errors.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.hpp"
#include "errors.hpp"
#include "pipeline/executor.hpp"
#include "plugin/loader.hpp"
#include "schedule/schedule.hpp"
#include "simulate/simulate.hpp"

namespace {

using meshrun::Communicator;
using meshrun::FlatTensor;
using meshrun::pipeline::Executor;
using meshrun::pipeline::HeldStage;
using meshrun::pipeline::StepTimes;
using meshrun::schedule::ActionType;
using meshrun::schedule::Schedule;

struct Options {
  std::string schedule;
  int64_t microbatches = 8;
  int steps = 5;
  double cost_ms = 10;
  int64_t numel = 4096;
  double duty = 0;  // 0: cores / ranks, at most 1
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; i += 2) {
    const std::string key = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(key + " needs a value");
    const std::string value = argv[i + 1];
    if (key == "--schedule") {
      options.schedule = value;
    } else if (key == "--microbatches") {
      options.microbatches = std::stoll(value);
    } else if (key == "--steps") {
      options.steps = std::stoi(value);
    } else if (key == "--cost-ms") {
      options.cost_ms = std::stod(value);
    } else if (key == "--numel") {
      options.numel = std::stoll(value);
    } else if (key == "--duty") {
      options.duty = std::stod(value);
    } else {
      throw std::invalid_argument("unknown option or value: " + key + " " + value);
    }
  }
  if (options.schedule.empty()) throw std::invalid_argument("--schedule is required");
  if (options.steps < 1 || options.microbatches < 1 || options.cost_ms <= 0 || options.numel < 1) {
    throw std::invalid_argument("--steps, --microbatches, --cost-ms and --numel must be positive");
  }
  if (options.duty < 0 || options.duty > 1) throw std::invalid_argument("--duty must be in [0, 1]");
  return options;
}

using Clock = std::chrono::steady_clock;

Clock::time_point after(Clock::time_point start, double seconds) {
  return start +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Keeps a share `duty` of the core busy until `seconds` of wall time have
// passed: computes (a dependent chain of multiply-adds the compiler cannot
// drop) for `duty` of every 0.4 ms period and sleeps the rest.
void busy(double seconds, double duty) {
  constexpr double kPeriod = 0.4e-3;
  const Clock::time_point deadline = after(Clock::now(), seconds);
  volatile double sink = 1.0;
  double x = sink;
  for (Clock::time_point now = Clock::now(); now < deadline; now = Clock::now()) {
    const Clock::time_point spin_end = std::min(deadline, after(now, kPeriod * duty));
    while (Clock::now() < spin_end) {
      for (int i = 0; i < 100; ++i) x = x * 0.999999 + 1e-6;
    }
    if (duty < 1.0) std::this_thread::sleep_until(std::min(deadline, after(now, kPeriod)));
  }
  sink = x;
}

// The share of a core each rank may keep busy when every rank computes at
// once without oversubscribing the cores (this machine's: the ranks are
// taken to share one node).
double default_duty(int64_t ranks) {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  return std::min(1.0, cores / static_cast<double>(ranks));
}

// A stage of fixed cost: F copies its input (or the microbatch number) to
// its output; gradients are passed through.
class SyntheticStage : public meshrun::pipeline::StageWork {
 public:
  SyntheticStage(bool first, bool last, int64_t numel, double t_seconds, double duty)
      : first_(first), last_(last), numel_(numel), t_(t_seconds), duty_(duty) {}

  int64_t input_numel() const override { return first_ ? 0 : numel_; }
  int64_t output_numel() const override { return last_ ? 0 : numel_; }
  void forward(int32_t microbatch, const float* input, float* output) override {
    busy(t_, duty_);
    if (output != nullptr) pass(input, output, static_cast<float>(microbatch));
  }
  void backward(int32_t, const float* grad_output, float* grad_input) override {
    busy(2 * t_, duty_);
    if (grad_input != nullptr) pass(grad_output, grad_input, 1.0f);
  }
  void backward_input(int32_t, const float* grad_output, float* grad_input) override {
    busy(t_, duty_);
    if (grad_input != nullptr) pass(grad_output, grad_input, 1.0f);
  }
  void backward_weight(int32_t) override { busy(t_, duty_); }

 private:
  void pass(const float* from, float* to, float fill) const {
    if (from != nullptr) {
      std::memcpy(to, from, static_cast<size_t>(numel_) * sizeof(float));
    } else {
      std::fill(to, to + numel_, fill);
    }
  }

  bool first_;
  bool last_;
  int64_t numel_;
  double t_;
  double duty_;
};

// The relative costs the synthetic stages have, for the simulator.
meshrun::schedule::Costs relative_costs() {
  meshrun::schedule::Costs costs;
  costs.F = 1;
  costs.B = 2;
  costs.I = 1;
  costs.W = 1;
  return costs;
}

// What rank `rank`'s compute actions cost in all, in units of T.
double nominal_compute(const Schedule& schedule, int64_t rank) {
  const meshrun::schedule::Costs costs = relative_costs();
  double total = 0;
  for (const auto& action : schedule.ranks[static_cast<size_t>(rank)]) {
    if (action && meshrun::schedule::is_compute(action->type)) total += costs.of(action->type);
  }
  return total;
}

// Every rank's (wall, compute, wait) of every measured step, on rank 0.
std::vector<float> gather_times(Communicator& world, const std::vector<StepTimes>& steps) {
  std::vector<float> mine;
  for (const StepTimes& t : steps) {
    mine.insert(mine.end(), {static_cast<float>(t.wall_s), static_cast<float>(t.compute_s),
                             static_cast<float>(t.wait_s)});
  }
  std::vector<float> all(mine.size() * static_cast<size_t>(world.size()));
  FlatTensor send(mine.data(), meshrun::dtype_float32(), static_cast<int64_t>(mine.size()));
  FlatTensor recv(all.data(), meshrun::dtype_float32(), static_cast<int64_t>(all.size()));
  world.all_gather(send.get(), recv.get()).wait();
  return all;
}

nlohmann::json report(const Options& options, const Schedule& compute_only,
                      const meshrun::schedule::Simulation& simulation,
                      const std::vector<float>& all, double t_seconds, double duty) {
  const auto ranks = static_cast<size_t>(compute_only.pp);
  const auto steps = static_cast<size_t>(options.steps);
  const auto at = [&](size_t rank, size_t step, size_t field) {
    return static_cast<double>(all[(rank * steps + step) * 3 + field]);
  };
  std::vector<double> makespans(steps, 0.0);
  for (size_t k = 0; k < steps; ++k) {
    for (size_t r = 0; r < ranks; ++r) makespans[k] = std::max(makespans[k], at(r, k, 0));
  }
  double step_time = 0;
  for (double makespan : makespans) step_time += makespan / static_cast<double>(steps);
  nlohmann::json per_rank = nlohmann::json::array();
  double idle_sum = 0;
  for (size_t r = 0; r < ranks; ++r) {
    double idle = 0, wait = 0, compute = 0;
    for (size_t k = 0; k < steps; ++k) {
      idle += (1.0 - at(r, k, 1) / makespans[k]) / static_cast<double>(steps);
      wait += at(r, k, 2) / makespans[k] / static_cast<double>(steps);
      compute += at(r, k, 1) / static_cast<double>(steps);
    }
    idle_sum += idle;
    per_rank.push_back(
        {{"rank", r},
         {"idle_share", idle},
         {"simulated_idle_share", simulation.idle[r] / simulation.makespan},
         {"wait_share", wait},
         {"compute_stretch", compute / (nominal_compute(compute_only, r) * t_seconds)}});
  }
  return {{"schedule", compute_only.name},
          {"pp", compute_only.pp},
          {"stages_per_rank", compute_only.stages_per_rank},
          {"microbatches", compute_only.microbatches},
          {"steps", options.steps},
          {"cost_ms", options.cost_ms},
          {"duty", duty},
          {"step_time_s", step_time},
          {"simulated_step_time_s", simulation.makespan * t_seconds},
          {"microbatches_per_s", static_cast<double>(compute_only.microbatches) / step_time},
          {"idle_share", idle_sum / static_cast<double>(ranks)},
          {"simulated_bubble", simulation.bubble_fraction},
          {"ranks", per_rank}};
}

int run(const Options& options) {
  const auto loader = meshrun::PluginLoader::from_environment();
  meshrun::CommBackend backend(loader, "mpi");
  Communicator world = backend.world(300.0);
  const auto plugin = loader.load(meshrun::PluginKind::schedule, options.schedule);
  const Schedule compute_only = meshrun::schedule::generate(
      *plugin, world.size(), plugin->api().schedule->stages_per_rank, options.microbatches);
  const Schedule lowered = meshrun::schedule::lower(compute_only);
  const double t_seconds = options.cost_ms * 1e-3 / static_cast<double>(lowered.stages_per_rank);
  const double duty = options.duty > 0 ? options.duty : default_duty(world.size());

  std::vector<std::unique_ptr<SyntheticStage>> owned;
  std::map<int64_t, HeldStage> held;
  for (int64_t s = 0; s < lowered.stages(); ++s) {
    if (lowered.stage_rank[static_cast<size_t>(s)] != world.rank()) continue;
    owned.push_back(std::make_unique<SyntheticStage>(s == 0, s == lowered.stages() - 1,
                                                     options.numel, t_seconds, duty));
    held.emplace(s, HeldStage{*owned.back()});
  }
  Executor executor(lowered, world.rank(), world, held);
  // One step unmeasured: first-touch of buffers and the backend's
  // connections.
  executor.run_step();
  std::vector<StepTimes> steps;
  for (int k = 0; k < options.steps; ++k) {
    world.barrier().wait();
    steps.push_back(executor.run_step());
  }
  const std::vector<float> all = gather_times(world, steps);
  if (world.rank() == 0) {
    const auto simulation = meshrun::schedule::simulate(compute_only, relative_costs());
    std::printf("%s\n",
                report(options, compute_only, simulation, all, t_seconds, duty).dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshrun-synthetic-pipeline: %s\n", e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshrun-synthetic-pipeline: %s\n", e.what());
    return 1;
  }
}
