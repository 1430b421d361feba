// The views a sharded strategy hands back (unit_views, local_shard), as the
// core's Strategy wrapper checks them: each broken property is refused with
// a message naming the strategy, the call and the property with the value
// seen. The strategy is the broken_views test plugin
// (tests/plugins/broken_views.cpp); it communicates nothing, so its
// communicator is a one-rank stand-in defined here.
#include <catch2/catch.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "errors.hpp"
#include "plugin/loader.hpp"
#include "strategy/strategy.hpp"

namespace {

using meshrun::Communicator;
using meshrun::Strategy;

const std::string kViewsPluginDir = MESHRUN_TEST_PLUGIN_DIR;

meshrun_error* solo_rank(const meshrun_communicator* /*communicator*/, int64_t* out) {
  *out = 0;
  return nullptr;
}

meshrun_error* solo_size(const meshrun_communicator* /*communicator*/, int64_t* out) {
  *out = 1;
  return nullptr;
}

void solo_destroy(meshrun_communicator* /*communicator*/) {}

// A comm table of one rank that answers rank and size only.
const meshrun_comm_api kSoloComm = [] {
  meshrun_comm_api api{};
  api.struct_size = sizeof(meshrun_comm_api);
  api.device_type = kDLCPU;
  api.rank = &solo_rank;
  api.size = &solo_size;
  api.communicator_destroy = &solo_destroy;
  return api;
}();

const meshrun_plugin_api kSoloPlugin = [] {
  meshrun_plugin_api api{};
  api.struct_size = sizeof(meshrun_plugin_api);
  api.abi_major = MESHRUN_ABI_VERSION_MAJOR;
  api.abi_minor = MESHRUN_ABI_VERSION_MINOR;
  api.kind = MESHRUN_PLUGIN_KIND_COMM;
  api.name = "solo";
  api.comm = &kSoloComm;
  return api;
}();

// Units: 0 (the root) holds 2 x 3 + 4 elements, 1 holds 3 x 3.
constexpr int32_t kUnit = 1;
constexpr int64_t kUnitNumel = 9;
constexpr int64_t kNumel = 19;

// The broken_views strategy, breaking its views as `mode` says, set up over
// a model of 3 parameters in 2 units on one rank.
class BrokenStrategy {
 public:
  explicit BrokenStrategy(const std::string& mode)
      : communicator_(std::make_shared<meshrun::PluginLibrary>(nullptr, &kSoloPlugin, "solo"),
                      reinterpret_cast<meshrun_communicator*>(&handle_), "dp") {
    meshrun::StrategyUnits units{&communicator_, &communicator_, 2, 0, {0, 1, 0}, {2, 3, 4}};
    strategy_ =
        std::make_unique<Strategy>(meshrun::PluginLoader({kViewsPluginDir})
                                       .load(meshrun::PluginKind::strategy, "broken_views"),
                                   communicator_,
                                   meshrun::StrategyBuffers{weights_.data(),
                                                            gradients_.data(),
                                                            kNumel,
                                                            {0, 6, 15, 19},
                                                            {"a.weight", "b.weight", "c.weight"}},
                                   "{\"break\": \"" + mode + "\"}", &units);
  }
  Strategy& operator*() { return *strategy_; }
  Strategy* operator->() { return strategy_.get(); }

 private:
  int handle_ = 0;
  Communicator communicator_;
  std::vector<float> weights_ = std::vector<float>(kNumel, 1.0f);
  std::vector<float> gradients_ = std::vector<float>(kNumel, 0.0f);
  std::unique_ptr<Strategy> strategy_;
};

}  // namespace

TEST_CASE("strategy views: well-formed views pass, gradient views only in a unit's backward",
          "[strategy]") {
  BrokenStrategy strategy("none");
  auto [parameters, gradients] = strategy->unit_views(kUnit);
  CHECK(parameters.data != nullptr);
  CHECK(parameters.numel == kUnitNumel);
  CHECK(gradients.data == nullptr);
  strategy->pre_backward(kUnit);
  gradients = strategy->unit_views(kUnit).second;
  CHECK(gradients.data != nullptr);
  CHECK(gradients.numel == kUnitNumel);
  strategy->post_backward(kUnit);
  CHECK(strategy->unit_views(kUnit).second.data == nullptr);
  const auto [shard_parameters, shard_gradients] = strategy->local_shard();
  CHECK(shard_parameters.numel == kNumel);
  CHECK(shard_gradients.numel == kNumel);
}

TEST_CASE("strategy views: a broken view is refused naming the strategy, call, property and value",
          "[strategy]") {
  struct Case {
    std::string mode;
    bool in_backward;  // the views are asked for inside unit 1's backward
    std::string call;  // unit_views or local_shard
    std::string message;
  };
  const std::string unit = "strategy broken_views unit_views(unit 1): ";
  const std::string backward = "strategy broken_views unit_views(unit 1) in the unit's backward: ";
  const std::string shard = "strategy broken_views local_shard: ";
  const std::vector<Case> cases = {
      {"dtype", false, "unit_views",
       unit + "parameters view has dtype code 2 bits 16, expected float32"},
      {"device", false, "unit_views",
       unit + "parameters view is on device type 2 id 0, expected the buffers' device type 1 id 0"},
      {"ndim", false, "unit_views", unit + "parameters view has 2 dimensions, expected 1"},
      {"strides", false, "unit_views", unit + "parameters view has stride 2, expected 1"},
      {"null_parameters", false, "unit_views", unit + "parameters view has data NULL"},
      {"unit_length", false, "unit_views",
       unit + "parameters view has 10 elements, expected 9 (the unit's parameter elements)"},
      {"gradient_length", true, "unit_views",
       backward + "gradients view has 8 elements, expected 9 (the unit's parameter elements)"},
      {"null_gradients", true, "unit_views", backward + "gradients view has data NULL"},
      {"shard_length", false, "local_shard",
       shard + "gradients view has 20 elements, expected 19 (as many as the parameters view)"},
      {"shard_null_gradients", false, "local_shard", shard + "gradients view has data NULL"},
  };
  for (const Case& test : cases) {
    INFO("mode " << test.mode);
    BrokenStrategy strategy(test.mode);
    if (test.in_backward) {
      // Outside the backward, no gradient view is asked for.
      CHECK_NOTHROW(strategy->unit_views(kUnit));
      strategy->pre_backward(kUnit);
    }
    bool refused = false;
    try {
      if (test.call == "unit_views") {
        strategy->unit_views(kUnit);
      } else {
        strategy->local_shard();
      }
    } catch (const meshrun::Error& e) {
      refused = true;
      CHECK(e.code() == MESHRUN_INTERNAL);
      CHECK(std::string(e.what()) == test.message);
    }
    CHECK(refused);
  }
}
