// Multi-process test of the ddp strategy plugin through the core's Strategy
// wrapper (core/strategy/strategy.hpp), run by ctest under mpirun:
//
//   mpirun -np 4 meshrun-ddp-test
//
// Every rank holds the same synthetic model (7 parameters of various sizes,
// about 3.3 MB of float32) with bucket_cap_mb 0.5, so the gradients fall into
// several buckets, and checks: parameters equal rank 0's after the broadcast;
// one sync step averages the gradients; three micro-batches with deferred
// sync reduce nothing until the last and then average the sums; readiness
// reported in a random order per rank (and in ranges of several parameters)
// gives the same result; a parameter never reported is an error naming it
// with find_unused_parameters = false, and is reduced as it stands with true;
// options and calls out of order are refused naming the key or the call; a
// strategy without training entry points is refused; and the all-reduces
// overlap a simulated backward, so that finish_gradients waits less than it
// does after a backward that reported nothing before its end. Rank 0 prints
// one line per section; a failing rank prints what failed. Exits 0 when
// every rank passed.
//
// Tolerance: none. Gradients are multiples of 1/4 below 64, so every sum
// over ranks and micro-batches is exact in float32, and so is its division
// by the (power-of-two) rank count.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checker.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "strategy/strategy.hpp"

namespace {

using meshrun::Communicator;
using meshrun::FlatTensor;
using meshrun::PluginLibrary;
using meshrun::Strategy;
using meshrun::test::Checker;
using Clock = std::chrono::steady_clock;

// 7 parameters of various sizes. With bucket_cap_mb 0.5 they fall into 6
// buckets: [5, 7), then one each for 4, 3, 2, 1 and 0.
const std::vector<int64_t> kNumels = {300000, 1000, 150000, 70000, 200000, 5000, 100000};
constexpr const char* kOptions = R"({"strategy": "ddp", "bucket_cap_mb": 0.5})";

// A host's model state: flat parameters and gradients, and the layout.
struct Model {
  explicit Model(const std::vector<int64_t>& numels) {
    offsets.push_back(0);
    for (size_t p = 0; p < numels.size(); ++p) {
      offsets.push_back(offsets.back() + numels[p]);
      names.push_back("model.layers." + std::to_string(p) + ".weight");
    }
    parameters.assign(static_cast<size_t>(offsets.back()), 0.0f);
    gradients.assign(static_cast<size_t>(offsets.back()), 0.0f);
  }
  int64_t numel() const { return offsets.back(); }
  int64_t num_parameters() const { return static_cast<int64_t>(names.size()); }
  meshrun::StrategyBuffers buffers() {
    return {parameters.data(), gradients.data(), numel(), offsets, names};
  }
  bool in_parameter(int64_t i, int64_t p) const {
    return i >= offsets[static_cast<size_t>(p)] && i < offsets[static_cast<size_t>(p) + 1];
  }

  std::vector<int64_t> offsets;
  std::vector<std::string> names;
  std::vector<float> parameters;
  std::vector<float> gradients;
};

// What rank `rank` computes for element i in micro-batch m.
float local_gradient(int64_t rank, int m, int64_t i) {
  return 0.25f * static_cast<float>((rank + 1) * (m + 1) + i % 13);
}

// Checks every gradient element against `expected`, reporting the first miss.
void check_gradients(Checker& checker, const Model& model, const std::string& what,
                     const std::function<double(int64_t)>& expected) {
  for (int64_t i = 0; i < model.numel(); ++i) {
    const double want = expected(i);
    if (model.gradients[static_cast<size_t>(i)] != static_cast<float>(want)) {
      checker.check(false, what + ": gradient[" + std::to_string(i) +
                               "] = " + std::to_string(model.gradients[static_cast<size_t>(i)]) +
                               ", expected " + std::to_string(want));
      return;
    }
  }
}

// The host's backward: adds this micro-batch's gradients to the buffer.
void accumulate(Model& model, int64_t rank, int micro_batch) {
  for (int64_t i = 0; i < model.numel(); ++i) {
    model.gradients[static_cast<size_t>(i)] += local_gradient(rank, micro_batch, i);
  }
}

void report(Strategy& strategy, const Model& model, int64_t p) {
  strategy.gradients_ready(model.offsets[static_cast<size_t>(p)],
                           model.offsets[static_cast<size_t>(p) + 1]);
}

void report_reverse(Strategy& strategy, const Model& model) {
  for (int64_t p = model.num_parameters() - 1; p >= 0; --p) report(strategy, model, p);
}

// The average over `world` ranks of the gradients summed over micro-batches
// [0, micro_batches).
double averaged(int64_t world, int micro_batches, int64_t i) {
  double sum = 0;
  for (int64_t r = 0; r < world; ++r) {
    for (int m = 0; m < micro_batches; ++m) sum += local_gradient(r, m, i);
  }
  return sum / static_cast<double>(world);
}

struct Context {
  Communicator& world;
  std::shared_ptr<PluginLibrary> ddp;
  Checker& checker;
  int64_t rank() const { return world.rank(); }
  int64_t size() const { return world.size(); }
  void section(const char* name) const {
    if (rank() == 0) std::printf("ddp test: %s\n", name);
  }
};

void refuses_bad_input(Context& c, const meshrun::PluginLoader& loader) {
  c.section("refuses a strategy without training entry points, bad options, calls out of order");
  Model model(kNumels);
  c.checker.expect_error("a strategy of mesh rules only (ABI 1.0 table)", MESHRUN_UNIMPLEMENTED,
                         {"meshrun_strategy_basic.so", "has no training entry points",
                          "training with strategy basic is not implemented yet"},
                         [&] {
                           Strategy(loader.load_file(MESHRUN_MESH_RULES_ONLY_STRATEGY), c.world,
                                    model.buffers(), kOptions);
                         });
  const std::vector<std::pair<std::string, std::string>> bad_options = {
      {R"({"bucket_cap_mb": -1})", "bucket_cap_mb"},
      {R"({"bucket_cap_mb": "25"})", "bucket_cap_mb"},
      {R"({"find_unused_parameters": "yes"})", "find_unused_parameters"},
      {R"({"static_graph": 1})", "static_graph"},
      {R"({"gradient_as_bucket_view": null})", "gradient_as_bucket_view"},
      {R"({"broadcast_buffers": []})", "broadcast_buffers"},
      {R"([1, 2])", "JSON object"},
      {R"({"bucket_cap_mb": )", "not JSON"},
  };
  // A named element, not a structured binding: clang before 16 cannot
  // capture a binding in a lambda.
  for (const auto& bad : bad_options) {
    const std::string& options = bad.first;
    c.checker.expect_error("options " + options, MESHRUN_INVALID_ARGUMENT, {bad.second},
                           [&] { Strategy(c.ddp, c.world, model.buffers(), options); });
  }
  Strategy strategy(c.ddp, c.world, model.buffers(), kOptions);
  c.checker.expect_error("finish_gradients before any micro-batch", MESHRUN_FAILED_PRECONDITION,
                         {"finish_gradients", "sync = 1"}, [&] { strategy.finish_gradients(); });
  c.checker.expect_error("gradients_ready outside a micro-batch", MESHRUN_FAILED_PRECONDITION,
                         {"gradients_ready"}, [&] { report(strategy, model, 0); });
  strategy.begin_micro_batch(false);
  c.checker.expect_error("a range that splits a parameter", MESHRUN_INVALID_ARGUMENT,
                         {"whole parameters"}, [&] { strategy.gradients_ready(0, 10); });
  c.checker.expect_error("a range past the buffer", MESHRUN_OUT_OF_RANGE, {"gradients_ready"},
                         [&] { strategy.gradients_ready(0, model.numel() + 1); });
  report(strategy, model, 2);
  c.checker.expect_error("a parameter reported twice", MESHRUN_INVALID_ARGUMENT,
                         {"model.layers.2.weight", "twice"}, [&] { report(strategy, model, 2); });
  c.checker.expect_error("finish_gradients after a non-sync micro-batch",
                         MESHRUN_FAILED_PRECONDITION, {"sync = 1"},
                         [&] { strategy.finish_gradients(); });
  const meshrun::StrategyMemory memory = strategy.memory();
  c.checker.check(memory.buffers == 0 && memory.buffers_peak == 0,
                  "buffers are views: no bytes of its own");
  c.checker.check(!strategy.sharded(), "ddp does not shard");
  c.checker.expect_error("a sharded entry point of ddp", MESHRUN_UNIMPLEMENTED,
                         {"pre_forward", "ABI 1.3"}, [&] { strategy.pre_forward(0); });
}

void broadcasts_parameters(Context& c) {
  c.section("broadcast_parameters: every rank ends with rank 0's parameters");
  Model model(kNumels);
  for (int64_t i = 0; i < model.numel(); ++i) {
    model.parameters[static_cast<size_t>(i)] = static_cast<float>(c.rank() * 1000 + i % 97);
  }
  Strategy strategy(c.ddp, c.world, model.buffers(), kOptions);
  strategy.broadcast_parameters();
  bool equal = true;
  for (int64_t i = 0; i < model.numel(); ++i) {
    equal = equal && model.parameters[static_cast<size_t>(i)] == static_cast<float>(i % 97);
  }
  c.checker.check(equal, "parameters equal rank 0's after broadcast_parameters");
}

void averages_one_step(Context& c) {
  c.section("one sync micro-batch, reverse order: gradients are the average");
  Model model(kNumels);
  Strategy strategy(c.ddp, c.world, model.buffers(), kOptions);
  strategy.begin_micro_batch(true);
  accumulate(model, c.rank(), 0);
  report_reverse(strategy, model);
  strategy.finish_gradients();
  check_gradients(c.checker, model, "sync step",
                  [&](int64_t i) { return averaged(c.size(), 1, i); });
}

void defers_sync(Context& c) {
  c.section("3 micro-batches, deferred sync: nothing reduced until the last, then the average");
  Model model(kNumels);
  Strategy strategy(c.ddp, c.world, model.buffers(), kOptions);
  constexpr int kMicroBatches = 3;
  for (int m = 0; m < kMicroBatches; ++m) {
    strategy.begin_micro_batch(m == kMicroBatches - 1);
    accumulate(model, c.rank(), m);
    report_reverse(strategy, model);
    if (m < kMicroBatches - 1) {
      check_gradients(c.checker, model, "local sum after non-sync micro-batch " + std::to_string(m),
                      [&](int64_t i) {
                        double sum = 0;
                        for (int k = 0; k <= m; ++k) sum += local_gradient(c.rank(), k, i);
                        return sum;
                      });
    }
  }
  strategy.finish_gradients();
  check_gradients(c.checker, model, "deferred sync",
                  [&](int64_t i) { return averaged(c.size(), kMicroBatches, i); });
}

void any_report_order(Context& c) {
  c.section("random report order per rank, ranges of several parameters, two steps");
  Model model(kNumels);
  Strategy strategy(c.ddp, c.world, model.buffers(), kOptions);
  std::mt19937 random(static_cast<uint32_t>(12345 + c.rank()));
  for (int step = 0; step < 2; ++step) {
    std::fill(model.gradients.begin(), model.gradients.end(), 0.0f);
    strategy.begin_micro_batch(true);
    accumulate(model, c.rank(), step);
    // Pairs of neighbours reported as one range, the pairs in random order.
    std::vector<int64_t> firsts;
    for (int64_t p = 0; p < model.num_parameters(); p += 2) firsts.push_back(p);
    std::shuffle(firsts.begin(), firsts.end(), random);
    for (int64_t p : firsts) {
      const int64_t last = std::min(p + 1, model.num_parameters() - 1);
      strategy.gradients_ready(model.offsets[static_cast<size_t>(p)],
                               model.offsets[static_cast<size_t>(last) + 1]);
    }
    strategy.finish_gradients();
    check_gradients(c.checker, model, "random order, step " + std::to_string(step), [&](int64_t i) {
      double sum = 0;
      for (int64_t r = 0; r < c.size(); ++r) sum += local_gradient(r, step, i);
      return sum / static_cast<double>(c.size());
    });
  }
}

void unused_parameters(Context& c) {
  c.section("find_unused_parameters: false names the missing parameter, true reduces it as is");
  constexpr int64_t kUnused = 3;  // reported by no rank; its gradient stays 0
  constexpr int64_t kPartly = 5;  // not reported by rank 1, whose gradient is 0
  Model model(kNumels);
  const auto run_step = [&](Strategy& strategy, bool skip_partly) {
    std::fill(model.gradients.begin(), model.gradients.end(), 0.0f);
    strategy.begin_micro_batch(true);
    accumulate(model, c.rank(), 0);
    for (int64_t p = model.num_parameters() - 1; p >= 0; --p) {
      const bool skipped = p == kUnused || (skip_partly && p == kPartly && c.rank() == 1);
      if (skipped) {
        std::fill(model.gradients.begin() + model.offsets[static_cast<size_t>(p)],
                  model.gradients.begin() + model.offsets[static_cast<size_t>(p) + 1], 0.0f);
      } else {
        report(strategy, model, p);
      }
    }
    strategy.finish_gradients();
  };
  {
    // Every rank misses the same parameter, so every rank stops before the
    // same bucket and the ones started before it complete everywhere.
    Strategy strict(c.ddp, c.world, model.buffers(), R"({"bucket_cap_mb": 0.5})");
    c.checker.expect_error("find_unused_parameters = false", MESHRUN_INVALID_ARGUMENT,
                           {"'model.layers.3.weight'", "find_unused_parameters = true"},
                           [&] { run_step(strict, false); });
    // The failed step left nothing in flight: the instance still works.
    strict.begin_micro_batch(true);
    report_reverse(strict, model);
    strict.finish_gradients();
  }
  Strategy lenient(c.ddp, c.world, model.buffers(),
                   R"({"bucket_cap_mb": 0.5, "find_unused_parameters": true})");
  run_step(lenient, true);
  check_gradients(c.checker, model, "find_unused_parameters = true", [&](int64_t i) {
    if (model.in_parameter(i, kUnused)) return 0.0;
    double sum = 0;
    for (int64_t r = 0; r < c.size(); ++r) {
      if (!(model.in_parameter(i, kPartly) && r == 1)) sum += local_gradient(r, 0, i);
    }
    return sum / static_cast<double>(c.size());
  });
}

// One sync step of a simulated backward over `model`: parameters reported
// last to first, `module_s` of compute after each. With `overlapped`, each is
// reported as its module finishes; without, all are reported at the end, as
// if the strategy reduced nothing during backward. Returns the time
// finish_gradients took.
double timed_step(Context& c, Strategy& strategy, Model& model, bool overlapped,
                  const std::vector<double>& module_s) {
  std::fill(model.gradients.begin(), model.gradients.end(), 0.0f);
  accumulate(model, c.rank(), 0);
  c.world.barrier().wait();
  strategy.begin_micro_batch(true);
  for (int64_t p = model.num_parameters() - 1; p >= 0; --p) {
    if (overlapped) report(strategy, model, p);
    std::this_thread::sleep_for(std::chrono::duration<double>(module_s[static_cast<size_t>(p)]));
  }
  if (!overlapped) report_reverse(strategy, model);
  const auto start = Clock::now();
  strategy.finish_gradients();
  const double finish_s = std::chrono::duration<double>(Clock::now() - start).count();
  check_gradients(c.checker, model, overlapped ? "overlapped step" : "step without overlap",
                  [&](int64_t i) { return averaged(c.size(), 1, i); });
  return finish_s;
}

void overlaps_backward(Context& c) {
  c.section("overlap: buckets reduce during backward, finish_gradients waits for the last only");
  // Seven 4 MiB parameters, each a bucket of its own under a 4 MiB cap, and
  // a small first one, reported last. Its module (the embedding) computes
  // long enough for every reduction started before it to finish.
  std::vector<int64_t> numels(8, int64_t{1} << 20);
  numels[0] = 1000;
  Model model(numels);
  std::vector<double> module_s(numels.size(), 0.002);
  module_s[1] = 0.3;
  Strategy strategy(c.ddp, c.world, model.buffers(), R"({"bucket_cap_mb": 4})");
  // Side by side, best of three each: the machine is shared and noisy.
  float times[2] = {1e9f, 1e9f};  // overlapped, not overlapped
  for (int trial = 0; trial < 3; ++trial) {
    for (int mode = 0; mode < 2; ++mode) {
      const double finish_s = timed_step(c, strategy, model, mode == 0, module_s);
      times[mode] = std::min(times[mode], static_cast<float>(finish_s));
    }
  }
  // One verdict for all ranks, from the slowest rank.
  FlatTensor both(times, meshrun::dtype_float32(), 2);
  c.world.all_reduce(both.get(), meshrun::ReduceOp::max).wait();
  if (c.rank() == 0) {
    std::printf(
        "ddp test:   %.1f MiB of gradients: finish_gradients waited %.2f ms overlapped, "
        "%.2f ms without overlap\n",
        static_cast<double>(model.numel()) * 4 / (1 << 20), times[0] * 1e3, times[1] * 1e3);
  }
  c.checker.check(times[0] < times[1],
                  "finish_gradients after an overlapped backward (" +
                      std::to_string(times[0] * 1e3) +
                      " ms) should wait less than after one that reported nothing before the "
                      "end (" +
                      std::to_string(times[1] * 1e3) + " ms)");
}

int run() {
  const auto loader = meshrun::PluginLoader::from_environment();
  meshrun::CommBackend backend(loader, "mpi");
  Communicator world = backend.world(120.0);
  Checker checker(world.rank());
  Context c{world, loader.load(meshrun::PluginKind::strategy, "ddp"), checker};
  refuses_bad_input(c, loader);
  broadcasts_parameters(c);
  averages_one_step(c);
  defers_sync(c);
  any_report_order(c);
  unused_parameters(c);
  overlaps_backward(c);

  return meshrun::test::verdict(world, checker, "ddp test");
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp test: %s\n", e.what());
    return 2;
  }
}
