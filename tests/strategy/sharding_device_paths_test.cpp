// The sharding engine's GPU code paths on host memory over 4 ranks, run by
// ctest under mpirun (engine_paths.hpp says how the paths run on the CPU):
//
//   mpirun -np 4 meshrun-sharding-device-paths-test
//
// The host device runs over the mpi backend as it is; the ordered device
// over the same communicators through a table whose collectives complete
// before their call returns, so that its at-once casts find every result.
// FSDP over 4 ranks and HSDP 2 x 2 (the reduce-scatter, then the all-reduce
// over replicas queued behind it), in every case of engine_paths::cases():
// every view, the local shard's gradients after each step and the gathered
// parameters must be equal bit for bit (the same collectives on the same
// numbers; blocking or not changes no arithmetic), and the compute stream
// must have waited for every gather it used. Exits 0 when every rank passed.
#include <cstdio>
#include <exception>
#include <string>

#include "checker.hpp"
#include "engine_paths.hpp"

namespace {

using meshrun::Communicator;
using meshrun::test::Checker;
using namespace meshrun::test::engine_paths;

// The mpi backend's table with every collective waited for inside its call.
const meshrun_comm_api* mpi_table = nullptr;

struct Completed {};

meshrun_error* completed(meshrun_error* error, meshrun_request** out_request) {
  if (error == nullptr && out_request != nullptr) {
    *out_request = reinterpret_cast<meshrun_request*>(new Completed);
  }
  return error;
}

meshrun_error* all_reduce(meshrun_communicator* c, const DLTensor* send, DLTensor* recv, int32_t op,
                          meshrun_request** out) {
  return completed(mpi_table->all_reduce(c, send, recv, op, nullptr), out);
}
meshrun_error* all_gather(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out) {
  return completed(mpi_table->all_gather(c, send, recv, nullptr), out);
}
meshrun_error* reduce_scatter(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                              int32_t op, meshrun_request** out) {
  return completed(mpi_table->reduce_scatter(c, send, recv, op, nullptr), out);
}
meshrun_error* broadcast(meshrun_communicator* c, DLTensor* tensor, int64_t root,
                         meshrun_request** out) {
  return completed(mpi_table->broadcast(c, tensor, root, nullptr), out);
}
meshrun_error* wait(meshrun_request*, double) { return nullptr; }
meshrun_error* test(meshrun_request*, int32_t* out_done) {
  *out_done = 1;
  return nullptr;
}
void request_destroy(meshrun_request* request) { delete reinterpret_cast<Completed*>(request); }

meshrun_comm_api blocking_table(const meshrun_comm_api& mpi) {
  mpi_table = &mpi;
  meshrun_comm_api table = mpi;
  table.all_reduce = &all_reduce;
  table.all_gather = &all_gather;
  table.reduce_scatter = &reduce_scatter;
  table.broadcast = &broadcast;
  table.wait = &wait;
  table.test = &test;
  table.request_destroy = &request_destroy;
  return table;
}

void compare(Checker& checker, const meshrun_comm_api& blocking, Communicator& world,
             Communicator& shard, Communicator& replicate, const char* layout) {
  const Groups host{world, shard, replicate, &world.comm_api()};
  const Groups ordered{world, shard, replicate, &blocking};
  for (const Case& c : cases()) {
    const auto [expected, got] = compare_case(c, host, ordered);
    const std::string what = std::string(layout) + ", " + c.name;
    const std::string difference = first_difference(expected, got);
    checker.check(difference.empty(), what + ": " + difference);
    checker.check(ledger.compute_waits == kExpectedComputeWaits,
                  what + ": the compute stream waited " + std::to_string(ledger.compute_waits) +
                      " times, not " + std::to_string(kExpectedComputeWaits));
    if (world.rank() == 0) std::printf("%s: %zu buffers compared\n", what.c_str(), got.size());
  }
}

int run() {
  const auto loader = meshrun::PluginLoader::from_environment();
  meshrun::CommBackend backend(loader, "mpi");
  Communicator world = backend.world(120.0);
  if (world.size() != 4) throw meshrun::invalid_argument("run on 4 ranks");
  Checker checker(world.rank());
  const meshrun_comm_api blocking = blocking_table(world.comm_api());
  Communicator solo = world.split(world.rank(), 0, "dp_replicate");
  compare(checker, blocking, world, world, solo, "FSDP over 4 ranks");
  Communicator hsdp_shard = world.split(world.rank() / 2, world.rank(), "dp_shard_cp");
  Communicator hsdp_replicate = world.split(world.rank() % 2, world.rank(), "dp_replicate");
  compare(checker, blocking, world, hsdp_shard, hsdp_replicate, "HSDP 2 x 2");
  return meshrun::test::verdict(world, checker, "sharding engine's device paths");
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharding device paths test: %s\n", e.what());
    return 2;
  }
}
