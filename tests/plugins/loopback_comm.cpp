// A comm plugin for a job of one rank, on host memory: every collective over
// one rank is a copy (or nothing), so the tests that compare a GPU run with
// its CPU twin on one GPU need no MPI (the GPU machines have none). A job of
// more ranks, and point-to-point transfers (there is no peer), are refused.
#include <cstring>
#include <string>

#include "meshrun/comm.h"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::plugin::Error;
using meshrun::plugin::guard;

struct Communicator {
  std::string name;
};
struct Request {};

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(MESHRUN_INVALID_ARGUMENT, "loopback " + message);
}

// The bytes of a compact host tensor.
size_t bytes_of(const DLTensor* tensor, const char* what) {
  require(tensor != nullptr, std::string(what) + " is NULL");
  require(tensor->device.device_type == kDLCPU, std::string(what) + " is not on the CPU");
  size_t count = 1;
  for (int32_t d = 0; d < tensor->ndim; ++d) count *= static_cast<size_t>(tensor->shape[d]);
  return count * static_cast<size_t>((tensor->dtype.bits + 7) / 8);
}

char* bytes_at(const DLTensor* tensor) {
  return static_cast<char*>(tensor->data) + tensor->byte_offset;
}

// recv = send, for the collectives whose result over one rank is the input.
void copy(const DLTensor* send, DLTensor* recv) {
  const size_t bytes = bytes_of(send, "send");
  require(bytes_of(recv, "recv") == bytes, "send and recv differ in size");
  if (bytes_at(send) != bytes_at(recv)) std::memmove(bytes_at(recv), bytes_at(send), bytes);
}

// A completed request for the caller that asked for one.
void complete(meshrun_request** out_request) {
  if (out_request != nullptr) *out_request = reinterpret_cast<meshrun_request*>(new Request);
}

Communicator& self(const meshrun_communicator* communicator) {
  require(communicator != nullptr, "communicator is NULL");
  return *reinterpret_cast<Communicator*>(const_cast<meshrun_communicator*>(communicator));
}

meshrun_error* world(meshrun_plugin_instance*, const meshrun_bootstrap* bootstrap,
                     const meshrun_comm_options*, meshrun_communicator** out) {
  return guard([&] {
    require(out != nullptr, "world: out is NULL");
    require(bootstrap == nullptr || bootstrap->size == 1,
            "world: a job of one rank only, not " +
                std::to_string(bootstrap != nullptr ? bootstrap->size : 1));
    *out = reinterpret_cast<meshrun_communicator*>(new Communicator{"world"});
  });
}

meshrun_error* split(meshrun_communicator* parent, int64_t, int64_t, const char* name,
                     meshrun_communicator** out) {
  return guard([&] {
    self(parent);
    require(out != nullptr, "split: out is NULL");
    *out = reinterpret_cast<meshrun_communicator*>(new Communicator{name != nullptr ? name : ""});
  });
}

void communicator_destroy(meshrun_communicator* communicator) {
  delete reinterpret_cast<Communicator*>(communicator);
}

meshrun_error* rank(const meshrun_communicator* communicator, int64_t* out_rank) {
  return guard([&] {
    self(communicator);
    require(out_rank != nullptr, "rank: out_rank is NULL");
    *out_rank = 0;
  });
}

meshrun_error* size(const meshrun_communicator* communicator, int64_t* out_size) {
  return guard([&] {
    self(communicator);
    require(out_size != nullptr, "size: out_size is NULL");
    *out_size = 1;
  });
}

meshrun_error* set_stream(meshrun_communicator* communicator, void*) {
  return guard([&] { self(communicator); });
}

meshrun_error* all_reduce(meshrun_communicator* communicator, const DLTensor* send, DLTensor* recv,
                          int32_t, meshrun_request** out_request) {
  return guard([&] {
    self(communicator);
    copy(send, recv);
    complete(out_request);
  });
}

meshrun_error* all_gather(meshrun_communicator* communicator, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out_request) {
  return all_reduce(communicator, send, recv, MESHRUN_REDUCE_SUM, out_request);
}

meshrun_error* reduce_scatter(meshrun_communicator* communicator, const DLTensor* send,
                              DLTensor* recv, int32_t op, meshrun_request** out_request) {
  return all_reduce(communicator, send, recv, op, out_request);
}

meshrun_error* broadcast(meshrun_communicator* communicator, DLTensor* tensor, int64_t root,
                         meshrun_request** out_request) {
  return guard([&] {
    self(communicator);
    bytes_of(tensor, "tensor");
    require(root == 0, "broadcast: root " + std::to_string(root) + " is not rank 0");
    complete(out_request);
  });
}

meshrun_error* no_peer(meshrun_communicator* communicator, int64_t peer) {
  return guard([&] {
    self(communicator);
    require(false, "point to point: peer " + std::to_string(peer) + " of a job of one rank");
  });
}

meshrun_error* send(meshrun_communicator* communicator, const DLTensor*, int64_t peer, int64_t,
                    meshrun_request**) {
  return no_peer(communicator, peer);
}

meshrun_error* recv(meshrun_communicator* communicator, DLTensor*, int64_t peer, int64_t,
                    meshrun_request**) {
  return no_peer(communicator, peer);
}

meshrun_error* barrier(meshrun_communicator* communicator, meshrun_request** out_request) {
  return guard([&] {
    self(communicator);
    complete(out_request);
  });
}

meshrun_error* wait(meshrun_request* request, double) {
  return guard([&] { require(request != nullptr, "wait: request is NULL"); });
}

meshrun_error* test(meshrun_request* request, int32_t* out_done) {
  return guard([&] {
    require(request != nullptr && out_done != nullptr, "test: request or out_done is NULL");
    *out_done = 1;
  });
}

void request_destroy(meshrun_request* request) { delete reinterpret_cast<Request*>(request); }

meshrun_error* all_to_all(meshrun_communicator* communicator, const DLTensor* send,
                          const int64_t* send_counts, DLTensor* recv, const int64_t* recv_counts,
                          meshrun_request** out_request) {
  return guard([&] {
    self(communicator);
    require(send_counts != nullptr && recv_counts != nullptr && send_counts[0] == recv_counts[0],
            "all_to_all: counts differ");
    const size_t element = static_cast<size_t>((send->dtype.bits + 7) / 8);
    std::memmove(bytes_at(recv), bytes_at(send), static_cast<size_t>(send_counts[0]) * element);
    complete(out_request);
  });
}

const meshrun_comm_api kCommApi = {
    .struct_size = sizeof(meshrun_comm_api),
    .device_type = kDLCPU,
    .extensions = nullptr,
    .world = &world,
    .split = &split,
    .communicator_destroy = &communicator_destroy,
    .rank = &rank,
    .size = &size,
    .set_stream = &set_stream,
    .all_reduce = &all_reduce,
    .all_gather = &all_gather,
    .reduce_scatter = &reduce_scatter,
    .broadcast = &broadcast,
    .send = &send,
    .recv = &recv,
    .barrier = &barrier,
    .wait = &wait,
    .test = &test,
    .request_destroy = &request_destroy,
    .all_to_all = &all_to_all,
};

const meshrun_plugin_api kApi = {
    .struct_size = sizeof(meshrun_plugin_api),
    .abi_major = MESHRUN_ABI_VERSION_MAJOR,
    .abi_minor = MESHRUN_ABI_VERSION_MINOR,
    .kind = MESHRUN_PLUGIN_KIND_COMM,
    .name = "loopback",
    .version = "test",
    .description = "a job of one rank on host memory: every collective a copy (tests only)",
    .create = &meshrun::plugin::create_instance<meshrun::plugin::HostServicesOnly>,
    .destroy = &meshrun::plugin::destroy_instance<meshrun::plugin::HostServicesOnly>,
    .strategy = nullptr,
    .schedule = nullptr,
    .sidecar = nullptr,
    .comm = &kCommApi,
    .extensions = nullptr,
    .model = nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
