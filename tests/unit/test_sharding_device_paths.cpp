// The sharding engine's GPU code paths, run on host memory on one rank
// (strategy/engine_paths.hpp says how), over the loopback test comm, whose
// collectives are done when their call returns. Every view, the local
// shard's gradients after each step and the gathered parameters must equal
// the host device's bit for bit, in every case of engine_paths::cases();
// the compute stream must have waited for every gather it used; a
// non-finite gradient must be reported alike. Under the sanitizers, this
// also checks the device paths' memory use. (Four ranks, with HSDP:
// strategy/sharding_device_paths_test.cpp.)
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.hpp"
#include "engine_paths.hpp"

namespace {

using namespace meshrun::test::engine_paths;

struct Loopback {
  Loopback()
      : loader({MESHRUN_TEST_PLUGIN_DIR}),
        backend(loader.load(meshrun::PluginKind::comm, "loopback")),
        world(backend.world(60.0)),
        solo(world.split(0, 0, "dp_replicate")) {}
  Groups groups() { return {world, world, solo, &world.comm_api()}; }

  meshrun::PluginLoader loader;
  meshrun::CommBackend backend;
  meshrun::Communicator world;
  meshrun::Communicator solo;
};

}  // namespace

TEST_CASE("sharding engine: the GPU's code paths on host memory give the host's bits",
          "[fsdp2][device]") {
  Loopback comm;
  for (const Case& c : cases()) {
    SECTION(c.name) {
      const auto [expected, got] = compare_case(c, comm.groups(), comm.groups());
      CHECK(first_difference(expected, got) == "");
      CHECK(ledger.compute_waits == kExpectedComputeWaits);
      CHECK(ledger.events > 0);
    }
  }
}

TEST_CASE("sharding engine: a non-finite gradient is reported alike on the GPU's code paths",
          "[fsdp2][device]") {
  Loopback comm;
  std::vector<std::string> messages;
  for (const auto make : {&meshrun::strategies::make_device, &make_ordered}) {
    ledger = Ledger{};
    ledger.options.param_dtype = Dtype::float32;
    ledger.options.report_nan_in_param_grad = true;
    try {
      Script(make, comm.groups()).run(true);
      messages.emplace_back("no error");
    } catch (const meshrun::strategies::Error& e) {
      CHECK(e.code() == MESHRUN_FAILED_PRECONDITION);
      messages.emplace_back(e.what());
    }
  }
  CHECK_THAT(messages[0], Catch::Contains("'model.layers.1.up_proj.weight' holds nan (element 3)"));
  CHECK(messages[1] == messages[0]);
}
