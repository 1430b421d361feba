// Multi-process test of the fsdp2 strategy plugin through the core's
// Strategy wrapper (core/strategy/strategy.hpp), run by ctest under mpirun:
//
//   mpirun -np 4 meshrun-fsdp2-test
//
// Every rank holds the same synthetic model: 9 parameters in 4 units, with
// row counts that 4 ranks do not divide (7, 6, 9, 5, 11, 10), a 1-row
// parameter, a scalar, one with fewer rows than ranks (3), and a root unit
// (3) holding the first and the last two parameters, so its parameters are
// not contiguous in index order. The host's side is simulated: a forward
// and a backward call the hooks around every unit as a trainer does (the
// root enclosing the layers) and add rank-dependent gradients through the
// unit views. Checked against values computed here: the shard segments
// cover every element once over the shard group; unit views equal the
// weights (exact in float32, exactly the rounded weights in bfloat16 and
// float16, and the bfloat16 view a bfloat16 gather keeps the same numbers);
// the local shard's gradients are the average over the
// data-parallel ranks, with deferred and non-deferred sync over 2
// micro-batches, with bfloat16 reduction, and with HSDP (2 x 2, the
// communicators split here); every prefetch setting gives the same bits;
// which units stay gathered after forward (reshard_after_forward and
// AutoModel's heuristic), through unit_views and memory(); gather_parameters
// and the next step see the updated shard; ranks that start from different
// weights all hold data-parallel rank 0's after setup and
// broadcast_parameters, and broadcast_parameters equalizes replicas that
// drifted apart; a setup without weights (ABI 1.6) starts the shards at
// zero, takes the values the host writes into them, and ddp refuses it;
// plan_memory predicts the local shard (ddp: every element) before setup;
// bad setups and calls out of order are refused. Rank 0 prints one line per
// section; a failing rank prints what failed. Exits 0 when every rank
// passed.
//
// Tolerance: float32 reductions are checked to 1e-6 relative, because the
// backend sums the ranks' float32 values in an order of its own, and the
// micro-batches are summed in float32, so results may differ from the
// double-precision reference by a few float32 roundings (6e-8 each); the
// gradients are kept away from zero so that a relative bound is meaningful.
// bfloat16 reduction rounds every rank's value and the result to 8 bits of
// mantissa: 2^-7 relative.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "checker.hpp"
#include "comm/comm.hpp"
#include "errors.hpp"
#include "fsdp2_setup.hpp"
#include "meshrun/dtype.hpp"
#include "plugin/loader.hpp"
#include "strategy/strategy.hpp"

namespace {

using meshrun::Communicator;
using meshrun::FlatTensor;
using meshrun::PluginLibrary;
using meshrun::Strategy;
using meshrun::StrategyUnits;
using meshrun::test::Checker;
using Json = nlohmann::json;

using meshrun::test::Parameter;

constexpr int32_t kUnits = 4;
constexpr int32_t kRoot = 3;
const std::vector<int32_t> kLayers = {0, 1, 2};  // forward order
const std::vector<Parameter> kParameters = {
    {"model.embed_tokens.weight", 7, 5, kRoot},
    {"model.layers.0.self_attn.q_proj.weight", 6, 3, 0},
    {"model.layers.0.input_layernorm.weight", 1, 4, 0},  // one row
    {"model.layers.1.mlp.up_proj.weight", 9, 2, 1},
    {"model.layers.1.post_attention_layernorm.weight", 1, 1, 1},  // a scalar
    {"model.layers.2.mlp.down_proj.weight", 5, 3, 2},
    {"model.layers.2.self_attn.o_proj.weight", 3, 1, 2},  // fewer rows than ranks
    {"model.norm.weight", 11, 1, kRoot},
    {"lm_head.weight", 10, 5, kRoot},
};

// Not representable in 16 bits, so that rounding shows.
float initial_weight(int64_t i) {
  return 0.37f * static_cast<float>(i % 29) - 5.1f + 0.013f * static_cast<float>(i);
}

// What data-parallel rank `rank` computes for element i in micro-batch m;
// at least 0.5, so that relative tolerances mean something.
float local_gradient(int64_t rank, int m, int64_t i) {
  return 0.5f + 0.01f * static_cast<float>((rank + 1) * (m + 1)) +
         0.003f * static_cast<float>(i % 17);
}

// The average over `ranks` data-parallel ranks of the gradients summed over
// `micro_batches`.
double averaged(int64_t ranks, int micro_batches, int64_t i) {
  double sum = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    for (int m = 0; m < micro_batches; ++m) sum += local_gradient(r, m, i);
  }
  return sum / static_cast<double>(ranks);
}

float rounded(float value, const std::string& dtype) {
  if (dtype == "bfloat16") return meshrun::bfloat16_to_float(meshrun::float_to_bfloat16(value));
  if (dtype == "float16") return meshrun::float16_to_float(meshrun::float_to_float16(value));
  return value;
}

// The host's model state: the full weights (borrowed by setup only) and the
// layout.
struct Model {
  Model() {
    offsets.push_back(0);
    for (const Parameter& p : kParameters) {
      offsets.push_back(offsets.back() + p.rows * p.columns);
      names.emplace_back(p.name);
    }
    for (int64_t i = 0; i < numel(); ++i) weights.push_back(initial_weight(i));
    gradients.assign(weights.size(), 0.0f);
  }
  int64_t numel() const { return offsets.back(); }
  int64_t begin(size_t p) const { return offsets[p]; }
  int64_t end(size_t p) const { return offsets[p + 1]; }
  meshrun::StrategyBuffers buffers() {
    return {weights.data(), gradients.data(), numel(), offsets, names};
  }
  StrategyUnits units(Communicator& shard, Communicator& replicate) const {
    StrategyUnits units{&shard, &replicate, kUnits, kRoot, {}, {}};
    for (const Parameter& p : kParameters) {
      units.parameter_units.push_back(p.unit);
      units.parameter_rows.push_back(p.rows);
    }
    return units;
  }
  // The unit's parameters of `values` (the setup's layout), in index order.
  std::vector<float> unit_values(int32_t unit, const std::vector<float>& values) const {
    std::vector<float> out;
    for (size_t p = 0; p < kParameters.size(); ++p) {
      if (kParameters[p].unit != unit) continue;
      out.insert(out.end(), values.begin() + begin(p), values.begin() + end(p));
    }
    return out;
  }

  std::vector<int64_t> offsets;
  std::vector<std::string> names;
  std::vector<float> weights;
  std::vector<float> gradients;
};

// Elements of the unit's gathered buffer: its parameters padded to a
// multiple of the shard group's `ranks` (strategies/sharding/layout.hpp).
int64_t padded_unit_numel(const Model& model, int32_t unit, int64_t ranks) {
  const auto numel = static_cast<int64_t>(model.unit_values(unit, model.weights).size());
  return (numel + ranks - 1) / ranks * ranks;
}

std::string options_with(const Json& changes = Json::object()) {
  return meshrun::test::fsdp2_options_with(changes);
}

// The data-parallel, shard and replicate groups one strategy runs over.
struct Groups {
  Communicator& data_parallel;
  Communicator& shard;
  Communicator& replicate;
};

struct Context {
  Communicator& world;
  Groups fsdp;  // shard group = world, replicate groups of one rank
  Groups hsdp;  // 2 x 2: shard groups {0, 1}, {2, 3}; replicate {0, 2}, {1, 3}
  std::shared_ptr<PluginLibrary> fsdp2;
  Checker& checker;
  int64_t rank() const { return world.rank(); }
  void section(const std::string& name) const {
    if (rank() == 0) std::printf("fsdp2 test: %s\n", name.c_str());
  }
};

std::unique_ptr<Strategy> make_strategy(Context& c, Model& model, const Groups& groups,
                                        const std::string& options) {
  const StrategyUnits units = model.units(groups.shard, groups.replicate);
  return std::make_unique<Strategy>(c.fsdp2, groups.data_parallel, model.buffers(), options,
                                    &units);
}

// Checks the unit's parameter view against `expected` (exactly), and its
// bfloat16 view, where the strategy holds one, against the same numbers.
void check_view(Context& c, Strategy& strategy, int32_t unit, const std::vector<float>& expected,
                const std::string& what) {
  const auto [parameters, gradients] = strategy.unit_views(unit);
  const bool equal = parameters.numel == static_cast<int64_t>(expected.size()) &&
                     std::equal(expected.begin(), expected.end(), parameters.data);
  c.checker.check(equal, what + ": unit " + std::to_string(unit) + " view differs from weights");
  const meshrun::Bfloat16View bfloat16 = strategy.unit_views_bfloat16(unit);
  if (bfloat16.data == nullptr) return;
  bool bfloat16_equal = bfloat16.numel == static_cast<int64_t>(expected.size());
  for (int64_t i = 0; bfloat16_equal && i < bfloat16.numel; ++i) {
    bfloat16_equal = meshrun::bfloat16_to_float(bfloat16.data[i]) == expected[size_t(i)];
  }
  c.checker.check(bfloat16_equal,
                  what + ": unit " + std::to_string(unit) + " bfloat16 view differs from weights");
}

// A forward through the hooks, checking every unit's view against the unit's
// part of `weights`, and that no gradient view exists in forward.
void forward(Context& c, Strategy& strategy, const Model& model, const std::vector<float>& weights,
             const std::string& what) {
  const auto pre = [&](int32_t unit) {
    strategy.pre_forward(unit);
    check_view(c, strategy, unit, model.unit_values(unit, weights), what);
    c.checker.check(strategy.unit_views(unit).second.data == nullptr,
                    what + ": a gradient view in forward");
  };
  pre(kRoot);
  for (int32_t unit : kLayers) {
    pre(unit);
    strategy.post_forward(unit);
  }
  strategy.post_forward(kRoot);
}

// Adds this rank's gradients of micro-batch m to the unit's gradient view
// and reports each parameter ready.
void add_gradients(Strategy& strategy, const Model& model, int32_t unit, int64_t rank, int m) {
  const meshrun::FloatView gradients = strategy.unit_views(unit).second;
  int64_t at = 0;
  for (size_t p = 0; p < kParameters.size(); ++p) {
    if (kParameters[p].unit != unit) continue;
    for (int64_t i = model.begin(p); i < model.end(p); ++i) {
      gradients.data[at++] += local_gradient(rank, m, i);
    }
    strategy.gradients_ready(model.begin(p), model.end(p));
  }
}

// A backward through the hooks: the root's head first, the layers last to
// first, the root's embedding last.
void backward(Strategy& strategy, const Model& model, int64_t rank, int m) {
  strategy.pre_backward(kRoot);
  for (auto unit = kLayers.rbegin(); unit != kLayers.rend(); ++unit) {
    strategy.pre_backward(*unit);
    add_gradients(strategy, model, *unit, rank, m);
    strategy.post_backward(*unit);
  }
  add_gradients(strategy, model, kRoot, rank, m);
  strategy.post_backward(kRoot);
}

// One optimizer step's micro-batches, the last one syncing; the host zeroes
// the shard's gradients first.
void step(Context& c, Strategy& strategy, const Model& model, int micro_batches,
          const std::vector<float>& weights, const std::string& what) {
  const meshrun::FloatView shard_gradients = strategy.local_shard().second;
  std::fill_n(shard_gradients.data, shard_gradients.numel, 0.0f);
  for (int m = 0; m < micro_batches; ++m) {
    strategy.begin_micro_batch(m == micro_batches - 1);
    forward(c, strategy, model, weights, what);
    backward(strategy, model, c.world.rank(), m);
  }
  strategy.finish_gradients();
}

// Which local elements the segments cover.
std::vector<bool> covered(Strategy& strategy) {
  std::vector<bool> in_segment(static_cast<size_t>(strategy.local_shard().first.numel), false);
  for (const meshrun_shard_segment& s : strategy.shard_segments()) {
    std::fill_n(in_segment.begin() + s.local_begin, s.count, true);
  }
  return in_segment;
}

// Checks every segment element of the local shard's gradients against
// `expected` (of the global index) within `relative`, and the padding is 0.
void check_shard_gradients(Context& c, Strategy& strategy, const std::string& what,
                           int micro_batches, double relative) {
  const meshrun::FloatView gradients = strategy.local_shard().second;
  const int64_t ranks = 4;  // every data-parallel rank of the world
  for (const meshrun_shard_segment& s : strategy.shard_segments()) {
    for (int64_t k = 0; k < s.count; ++k) {
      const double want = averaged(ranks, micro_batches, s.global_begin + k);
      const double got = gradients.data[s.local_begin + k];
      if (std::abs(got - want) > relative * std::abs(want)) {
        c.checker.check(false, what + ": gradient of element " +
                                   std::to_string(s.global_begin + k) + " is " +
                                   std::to_string(got) + ", expected " + std::to_string(want));
        return;
      }
    }
  }
  const std::vector<bool> in_segment = covered(strategy);
  bool padding_zero = true;
  for (size_t i = 0; i < in_segment.size(); ++i) {
    padding_zero = padding_zero && (in_segment[i] || gradients.data[i] == 0.0f);
  }
  c.checker.check(padding_zero, what + ": padding gradients are not zero");
}

void refuses_bad_setup(Context& c, const meshrun::PluginLoader& loader) {
  c.section("refuses bad options, units, rows, groups and a setup struct of ABI 1.2");
  Model model;
  const std::vector<std::pair<std::string, Json>> bad_options = {
      {"/pp_size", 0},
      {"/pp_size", "2"},
      {"/reshard_after_forward", "yes"},
      {"/defer_fsdp_grad_sync", nullptr},
      {"/enable_fsdp2_prefetch", 1},
      {"/fsdp2_forward_prefetch_depth", -1},
      {"/fsdp2_backward_prefetch_depth", 1.5},
      {"/mp_policy", nullptr},
      {"/mp_policy/param_dtype", "int8"},
      {"/mp_policy/reduce_dtype", 3},
      {"/mp_policy/output_dtype", "float64"},
      {"/mp_policy/cast_forward_inputs", "no"},
  };
  for (const auto& [pointer, value] : bad_options) {
    Json options = Json::parse(options_with());
    options[Json::json_pointer(pointer)] = value;
    std::string key = pointer.substr(1);
    std::replace(key.begin(), key.end(), '/', '.');
    c.checker.expect_error("option " + pointer, MESHRUN_INVALID_ARGUMENT, {"fsdp2", key}, [&] {
      const StrategyUnits units = model.units(c.world, c.fsdp.replicate);
      Strategy(c.fsdp2, c.world, model.buffers(), options.dump(), &units);
    });
  }
  const auto refuses_units = [&](const std::string& what, const std::vector<std::string>& parts,
                                 auto&& change) {
    StrategyUnits units = model.units(c.world, c.fsdp.replicate);
    change(units);
    c.checker.expect_error(what, MESHRUN_INVALID_ARGUMENT, parts, [&] {
      Strategy(c.fsdp2, c.world, model.buffers(), options_with(), &units);
    });
  };
  refuses_units("rows not dividing the elements",
                {"'model.layers.0.self_attn.q_proj.weight'", "18 elements", "4 rows"},
                [](StrategyUnits& u) { u.parameter_rows[1] = 4; });
  refuses_units("a parameter in no unit", {"'model.layers.1.mlp.up_proj.weight'", "unit 7"},
                [](StrategyUnits& u) { u.parameter_units[3] = 7; });
  refuses_units("a root unit out of range", {"root_unit"},
                [](StrategyUnits& u) { u.root_unit = kUnits; });
  refuses_units("a NULL shard group", {"shard_group is NULL"},
                [](StrategyUnits& u) { u.shard_group = nullptr; });
  refuses_units("a NULL replicate group", {"replicate_group is NULL"},
                [](StrategyUnits& u) { u.replicate_group = nullptr; });
  c.checker.expect_error("a sharded strategy without units", MESHRUN_INVALID_ARGUMENT,
                         {"fsdp2", "StrategyUnits"},
                         [&] { Strategy(c.fsdp2, c.world, model.buffers(), options_with()); });

  // Through the table itself: the wrapper always sends the whole struct.
  meshrun::PluginInstance instance(loader.load(meshrun::PluginKind::strategy, "fsdp2"));
  meshrun_strategy_setup setup{};
  setup.struct_size = MESHRUN_STRATEGY_SETUP_SIZE_1_2;
  c.checker.expect_error("a setup struct of ABI 1.2", MESHRUN_INVALID_ARGUMENT,
                         {"fsdp2", "struct_size", "1.3"}, [&] {
                           meshrun::throw_if_error(
                               instance.library().api().strategy->setup(instance.handle(), &setup));
                         });
}

void segments_partition(Context& c, const Groups& groups, const std::string& name) {
  c.section(name + ": shard segments cover every element once over the shard group");
  Model model;
  const auto strategy = make_strategy(c, model, groups, options_with());
  const auto [parameters, gradients] = strategy->local_shard();
  std::vector<int32_t> count(static_cast<size_t>(model.numel()), 0);
  bool values_match = true;
  int64_t local_end = 0;
  for (const meshrun_shard_segment& s : strategy->shard_segments()) {
    const auto p = static_cast<size_t>(s.parameter);
    c.checker.check(s.global_begin >= model.begin(p) && s.global_begin + s.count <= model.end(p),
                    "segment of parameter " + std::to_string(p) + " leaves the parameter");
    c.checker.check(s.local_begin >= local_end && s.count > 0, "segments overlap or are empty");
    local_end = s.local_begin + s.count;
    for (int64_t k = 0; k < s.count; ++k) {
      ++count[static_cast<size_t>(s.global_begin + k)];
      values_match = values_match && parameters.data[s.local_begin + k] ==
                                         model.weights[static_cast<size_t>(s.global_begin + k)];
    }
  }
  c.checker.check(local_end <= parameters.numel && gradients.numel == parameters.numel,
                  "segments lie within the local shard");
  c.checker.check(values_match, "the local shard holds the weights of its segments");
  const std::vector<bool> in_segment = covered(*strategy);
  bool padding_zero = true;
  for (size_t i = 0; i < in_segment.size(); ++i) {
    padding_zero = padding_zero && (in_segment[i] || parameters.data[i] == 0.0f);
  }
  c.checker.check(padding_zero, "padding parameters are zero");
  FlatTensor counts(count.data(), meshrun::dtype_int32(), model.numel());
  groups.shard.all_reduce(counts.get(), meshrun::ReduceOp::sum).wait();
  c.checker.check(std::all_of(count.begin(), count.end(), [](int32_t n) { return n == 1; }),
                  "every element is in exactly one rank's segments");
}

void views_equal_weights(Context& c) {
  for (const std::string dtype : {"float32", "bfloat16", "float16"}) {
    c.section("param_dtype " + dtype + ": unit views hold the weights rounded to it");
    Model model;
    const auto strategy =
        make_strategy(c, model, c.fsdp, options_with({{"mp_policy", {{"param_dtype", dtype}}}}));
    std::vector<float> expected = model.weights;
    for (float& value : expected) value = rounded(value, dtype);
    // Outside a step, as an evaluation runs.
    forward(c, *strategy, model, expected, dtype);
    strategy->pre_forward(kRoot);
    c.checker.check((strategy->unit_views_bfloat16(kRoot).data != nullptr) == (dtype == "bfloat16"),
                    dtype + ": a bfloat16 view exactly when gathering in bfloat16");
    strategy->post_forward(kRoot);
  }
}

void reduces_gradients(Context& c, const Groups& groups, const std::string& name) {
  const std::vector<std::pair<std::string, Json>> cases = {
      {"1 micro-batch", Json::object()},
      {"2 micro-batches, deferred sync", Json::object()},
      {"2 micro-batches, defer_fsdp_grad_sync = false", {{"defer_fsdp_grad_sync", false}}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const int micro_batches = i == 0 ? 1 : 2;
    c.section(name + ", " + cases[i].first + ": shard gradients are the dp average");
    Model model;
    const auto strategy = make_strategy(c, model, groups, options_with(cases[i].second));
    step(c, *strategy, model, micro_batches, model.weights, cases[i].first);
    check_shard_gradients(c, *strategy, name + ", " + cases[i].first, micro_batches, 1e-6);
  }
  c.section(name + ", reduce_dtype bfloat16: the average to bfloat16 precision");
  Model model;
  const auto strategy = make_strategy(
      c, model, groups, options_with({{"mp_policy", {{"reduce_dtype", "bfloat16"}}}}));
  step(c, *strategy, model, 2, model.weights, "bfloat16 reduction");
  check_shard_gradients(c, *strategy, name + ", bfloat16 reduction", 2, 1.0 / 128);
}

void defers_until_sync(Context& c) {
  c.section("deferred sync: a non-sync micro-batch reduces nothing and keeps unit gradients");
  Model model;
  const auto strategy = make_strategy(c, model, c.fsdp, options_with());
  strategy->begin_micro_batch(false);
  forward(c, *strategy, model, model.weights, "non-sync micro-batch");
  backward(*strategy, model, c.rank(), 0);
  const meshrun::FloatView gradients = strategy->local_shard().second;
  c.checker.check(std::all_of(gradients.data, gradients.data + gradients.numel,
                              [](float g) { return g == 0.0f; }),
                  "shard gradients stay zero before the sync micro-batch");
  int64_t unreduced_bytes = 0;
  for (int32_t unit = 0; unit < kUnits; ++unit) {
    unreduced_bytes += padded_unit_numel(model, unit, c.world.size()) * int64_t{sizeof(float)};
  }
  c.checker.check(strategy->memory().buffers == unreduced_bytes,
                  "the unreduced gradients of every unit are held, nothing else: " +
                      std::to_string(strategy->memory().buffers) + " bytes");
  strategy->begin_micro_batch(true);
  forward(c, *strategy, model, model.weights, "sync micro-batch");
  backward(*strategy, model, c.rank(), 1);
  strategy->finish_gradients();
  check_shard_gradients(c, *strategy, "deferred, then synced", 2, 1e-6);
}

void prefetch_changes_nothing(Context& c) {
  c.section("prefetch off, depths 0, 1, 2 and beyond the units: the same views and bits");
  const std::vector<Json> settings = {
      {{"enable_fsdp2_prefetch", false}},
      {{"fsdp2_forward_prefetch_depth", 0}, {"fsdp2_backward_prefetch_depth", 0}},
      {{"fsdp2_forward_prefetch_depth", 1}, {"fsdp2_backward_prefetch_depth", 1}},
      {{"fsdp2_forward_prefetch_depth", 2}, {"fsdp2_backward_prefetch_depth", 2}},
      {{"fsdp2_forward_prefetch_depth", 5}, {"fsdp2_backward_prefetch_depth", 7}},
  };
  std::vector<float> first;
  for (const Json& setting : settings) {
    Json changes = setting;
    changes["mp_policy"] = {{"param_dtype", "bfloat16"}};
    Model model;
    const auto strategy = make_strategy(c, model, c.fsdp, options_with(changes));
    std::vector<float> expected = model.weights;
    for (float& value : expected) value = rounded(value, "bfloat16");
    step(c, *strategy, model, 2, expected, "prefetch " + setting.dump());
    const meshrun::FloatView gradients = strategy->local_shard().second;
    const std::vector<float> result(gradients.data, gradients.data + gradients.numel);
    if (first.empty()) first = result;
    c.checker.check(result == first, "prefetch " + setting.dump() + " changed the gradients");
  }
}

// Whether the unit's views exist; a resharded unit has none.
bool gathered(Strategy& strategy, int32_t unit) {
  try {
    strategy.unit_views(unit);
    return true;
  } catch (const meshrun::Error& e) {
    if (e.code() != MESHRUN_FAILED_PRECONDITION) throw;
    return false;
  }
}

void reshards_after_forward(Context& c) {
  struct Case {
    std::string what;
    Json changes;
    std::set<int32_t> gathered;  // after the forward
  };
  const std::vector<Case> cases = {
      {"unset, no pipeline: all but the root and the last layer", Json::object(), {2, kRoot}},
      {"unset, pp_size 2: none", {{"pp_size", 2}}, {0, 1, 2, kRoot}},
      {"true: all but the root", {{"reshard_after_forward", true}}, {kRoot}},
      {"false: none", {{"reshard_after_forward", false}}, {0, 1, 2, kRoot}},
  };
  for (const Case& test : cases) {
    c.section("reshard_after_forward " + test.what);
    Model model;
    const auto strategy = make_strategy(c, model, c.fsdp, options_with(test.changes));
    strategy->begin_micro_batch(true);
    forward(c, *strategy, model, model.weights, test.what);
    int64_t gathered_bytes = 0;
    for (int32_t unit = 0; unit < kUnits; ++unit) {
      const bool expected = test.gathered.count(unit) > 0;
      if (expected) {
        gathered_bytes += padded_unit_numel(model, unit, c.world.size()) * int64_t{sizeof(float)};
      }
      c.checker.check(gathered(*strategy, unit) == expected,
                      test.what + ": unit " + std::to_string(unit) +
                          (expected ? " was resharded" : " stayed gathered"));
    }
    c.checker.check(strategy->memory().buffers == gathered_bytes,
                    test.what + ": memory holds the gathered units only: " +
                        std::to_string(strategy->memory().buffers) + " bytes, expected " +
                        std::to_string(gathered_bytes));
    backward(*strategy, model, c.rank(), 0);
    strategy->finish_gradients();
    const meshrun::StrategyMemory memory = strategy->memory();
    c.checker.check(memory.buffers == 0 && memory.buffers_peak >= gathered_bytes,
                    test.what + ": everything released after finish_gradients, peak kept");
  }
}

void refuses_calls_out_of_order(Context& c) {
  c.section("calls out of order and units out of range are refused");
  Model model;
  const auto strategy = make_strategy(c, model, c.fsdp, options_with());
  Strategy& s = *strategy;
  const auto precondition = [&](const std::string& what, const std::vector<std::string>& parts,
                                auto&& body) {
    c.checker.expect_error(what, MESHRUN_FAILED_PRECONDITION, parts, body);
  };
  precondition("post_forward without pre_forward", {"post_forward", "unit 1"},
               [&] { s.post_forward(1); });
  precondition("pre_backward outside a micro-batch", {"begin_micro_batch"},
               [&] { s.pre_backward(kRoot); });
  precondition("unit_views of a sharded unit", {"not gathered"}, [&] { s.unit_views(0); });
  precondition("finish_gradients before any micro-batch", {"sync = 1"},
               [&] { s.finish_gradients(); });
  c.checker.expect_error("a unit out of range", MESHRUN_OUT_OF_RANGE, {"unit 4"},
                         [&] { s.pre_forward(kUnits); });
  c.checker.expect_error("a negative unit", MESHRUN_OUT_OF_RANGE, {"unit -1"},
                         [&] { s.unit_views(-1); });
  s.begin_micro_batch(false);
  s.pre_forward(kRoot);
  precondition("pre_forward twice", {"in its forward"}, [&] { s.pre_forward(kRoot); });
  precondition("post_backward without pre_backward", {"post_backward"},
               [&] { s.post_backward(kRoot); });
  precondition("begin_micro_batch inside a unit's forward", {"unit 3"},
               [&] { s.begin_micro_batch(true); });
  precondition("gather_parameters during a step", {"during a step"}, [&] {
    std::vector<float> full(static_cast<size_t>(model.numel()));
    s.gather_parameters(full.data(), model.numel());
  });
  s.post_forward(kRoot);
  s.pre_backward(kRoot);
  precondition("finish_gradients inside a unit's backward", {"finish_gradients"},
               [&] { s.finish_gradients(); });
  s.post_backward(kRoot);
  precondition("finish_gradients after a non-sync micro-batch", {"sync = 1"},
               [&] { s.finish_gradients(); });
  s.begin_micro_batch(true);
  precondition("begin_micro_batch after the sync one", {"finish_gradients"},
               [&] { s.begin_micro_batch(true); });
  c.checker.expect_error("a gradients_ready range splitting a parameter", MESHRUN_INVALID_ARGUMENT,
                         {"whole parameters"}, [&] { s.gradients_ready(0, 3); });
  s.finish_gradients();
}

// Adds `delta` to every shard element (not the padding).
void add_to_shard(Strategy& strategy, float delta) {
  for (const meshrun_shard_segment& s : strategy.shard_segments()) {
    float* parameters = strategy.local_shard().first.data + s.local_begin;
    for (int64_t k = 0; k < s.count; ++k) parameters[k] += delta;
  }
}

void gathers_updated_parameters(Context& c, const Groups& groups, const std::string& name) {
  c.section(name + ": gather_parameters and the next step see the updated shard");
  Model model;
  const auto strategy = make_strategy(c, model, groups, options_with());
  std::vector<float> updated = model.weights;
  for (float& value : updated) value += 1.0f;
  step(c, *strategy, model, 1, model.weights, "first step");
  // An evaluation leaves the root and the last layer gathered; the next
  // step must not use them once the shard has changed.
  forward(c, *strategy, model, model.weights, "evaluation");
  // The host's optimizer step, simulated.
  add_to_shard(*strategy, 1.0f);
  std::vector<float> full(static_cast<size_t>(model.numel()), -1.0f);
  strategy->gather_parameters(full.data(), model.numel());
  c.checker.check(full == updated, name + ": gather_parameters returns the updated weights");
  step(c, *strategy, model, 1, updated, "the step after the update");
}

void starts_from_rank_zero(Context& c, const Groups& groups, const std::string& name) {
  c.section(name +
            ": ranks that start apart all hold dp rank 0's weights after setup and "
            "broadcast_parameters");
  Model model;
  // Rank r's weights are off by r.
  const auto rank = static_cast<float>(groups.data_parallel.rank());
  for (float& value : model.weights) value += rank;
  const auto strategy = make_strategy(c, model, groups, options_with());
  // Borrowed for setup only: the host may reuse them.
  std::fill(model.weights.begin(), model.weights.end(), -1.0f);
  strategy->broadcast_parameters();
  std::vector<float> full(static_cast<size_t>(model.numel()), -2.0f);
  strategy->gather_parameters(full.data(), model.numel());
  std::vector<float> rank_zero;
  for (int64_t i = 0; i < model.numel(); ++i) rank_zero.push_back(initial_weight(i));
  c.checker.check(full == rank_zero, name + ": gather_parameters differs from dp rank 0's weights");
}

// The buffers of a host that starts the shards itself (ABI 1.6 weights by
// shard): no weights cross setup.
meshrun::StrategyBuffers without_weights(Model& model) {
  meshrun::StrategyBuffers buffers = model.buffers();
  buffers.parameters = nullptr;
  buffers.gradients = nullptr;
  return buffers;
}

void starts_by_shard(Context& c, const Groups& groups, const std::string& name,
                     const meshrun::PluginLoader& loader) {
  c.section(name + ": set up without weights, shards start at zero and take the host's values");
  Model model;
  const StrategyUnits units = model.units(groups.shard, groups.replicate);
  Strategy strategy(c.fsdp2, groups.data_parallel, without_weights(model), options_with(), &units);
  const auto [parameters, gradients] = strategy.local_shard();
  const bool zero = std::all_of(parameters.data, parameters.data + parameters.numel,
                                [](float value) { return value == 0.0f; });
  c.checker.check(zero, name + ": a shard set up without weights is not zero");
  for (const meshrun_shard_segment& s : strategy.shard_segments()) {
    for (int64_t k = 0; k < s.count; ++k) {
      parameters.data[s.local_begin + k] = initial_weight(s.global_begin + k);
    }
  }
  strategy.broadcast_parameters();
  std::vector<float> full(static_cast<size_t>(model.numel()), -1.0f);
  strategy.gather_parameters(full.data(), model.numel());
  c.checker.check(full == model.weights, name + ": gather_parameters differs from the host's");
  step(c, strategy, model, 1, model.weights, "the first step after starting by shard");
  c.checker.expect_error("ddp set up without weights", MESHRUN_INVALID_ARGUMENT,
                         {"meshrun_strategy_ddp", "weights_by_shard"}, [&] {
                           Strategy(loader.load(meshrun::PluginKind::strategy, "ddp"),
                                    groups.data_parallel, without_weights(model), options_with());
                         });
}

void plans_the_shard(Context& c, const Groups& groups, const std::string& name,
                     const meshrun::PluginLoader& loader) {
  c.section(name + ": plan_memory predicts the local shard before any setup; ddp every element");
  Model model;
  const StrategyUnits units = model.units(groups.shard, groups.replicate);
  const auto predicted =
      meshrun::plan_strategy_memory(c.fsdp2, without_weights(model), units, groups.shard.size(),
                                    groups.replicate.size(), options_with());
  const auto strategy = make_strategy(c, model, groups, options_with());
  c.checker.check(predicted && predicted->local_numel == strategy->local_shard().first.numel &&
                      predicted->buffers_held == 0,
                  name + ": plan_memory differs from the local shard set up");
  const auto replicated = meshrun::plan_strategy_memory(
      loader.load(meshrun::PluginKind::strategy, "ddp"), without_weights(model), units, 1,
      groups.data_parallel.size(), options_with());
  c.checker.check(
      replicated && replicated->local_numel == model.numel() && replicated->buffers_held == 0,
      name + ": ddp's plan_memory is not every parameter");
}

void broadcasts_replicas(Context& c) {
  c.section("HSDP: broadcast_parameters makes replicas equal to replicate-group rank 0's shard");
  Model model;
  const auto strategy = make_strategy(c, model, c.hsdp, options_with());
  // Replicas drift apart after setup: replica r's shard is off by r.
  add_to_shard(*strategy, static_cast<float>(c.hsdp.replicate.rank()));
  strategy->broadcast_parameters();
  const float* parameters = strategy->local_shard().first.data;
  bool equal = true;
  for (const meshrun_shard_segment& s : strategy->shard_segments()) {
    for (int64_t k = 0; k < s.count; ++k) {
      const int64_t i = s.global_begin + k;
      equal = equal && parameters[s.local_begin + k] == initial_weight(i);
    }
  }
  c.checker.check(equal, "the shard equals replica 0's after broadcast_parameters");
}

int run() {
  const auto loader = meshrun::PluginLoader::from_environment();
  meshrun::CommBackend backend(loader, "mpi");
  Communicator world = backend.world(120.0);
  if (world.size() != 4) throw meshrun::invalid_argument("run the fsdp2 test on 4 ranks");
  Checker checker(world.rank());
  Communicator solo = world.split(world.rank(), 0, "dp_replicate");
  Communicator hsdp_shard = world.split(world.rank() / 2, world.rank(), "dp_shard_cp");
  Communicator hsdp_replicate = world.split(world.rank() % 2, world.rank(), "dp_replicate");
  Context c{world,
            {world, world, solo},
            {world, hsdp_shard, hsdp_replicate},
            loader.load(meshrun::PluginKind::strategy, "fsdp2"),
            checker};
  c.checker.check(meshrun::strategy_can_train(*c.fsdp2), "fsdp2 can train");
  refuses_bad_setup(c, loader);
  segments_partition(c, c.fsdp, "FSDP over 4 ranks");
  segments_partition(c, c.hsdp, "HSDP 2 x 2");
  views_equal_weights(c);
  reduces_gradients(c, c.fsdp, "FSDP over 4 ranks");
  reduces_gradients(c, c.hsdp, "HSDP 2 x 2");
  defers_until_sync(c);
  prefetch_changes_nothing(c);
  reshards_after_forward(c);
  refuses_calls_out_of_order(c);
  gathers_updated_parameters(c, c.fsdp, "FSDP over 4 ranks");
  gathers_updated_parameters(c, c.hsdp, "HSDP 2 x 2");
  starts_from_rank_zero(c, c.fsdp, "FSDP over 4 ranks");
  starts_from_rank_zero(c, c.hsdp, "HSDP 2 x 2");
  broadcasts_replicas(c);
  starts_by_shard(c, c.fsdp, "FSDP over 4 ranks", loader);
  starts_by_shard(c, c.hsdp, "HSDP 2 x 2", loader);
  plans_the_shard(c, c.fsdp, "FSDP over 4 ranks", loader);
  plans_the_shard(c, c.hsdp, "HSDP 2 x 2", loader);
  return meshrun::test::verdict(world, checker, "fsdp2 test");
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp2 test: %s\n", e.what());
    return 2;
  }
}
