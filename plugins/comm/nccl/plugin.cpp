// The `nccl` comm plugin: collectives and point-to-point transfers of CUDA
// tensors over NCCL (meshrun/comm.h; behaviour in communicator.hpp). Every
// entry point checks its handles and turns whatever is thrown into an error.
// `create` makes no CUDA call, so the plugin loads and instantiates on a
// machine without a GPU; the first CUDA call is in `world`.
#include <dlpack/dlpack.h>

#include <memory>
#include <string>

#include "communicator.hpp"
#include "meshrun/plugin.hpp"

namespace {

using meshrun::nccl::Communicator;
using meshrun::nccl::Request;
using meshrun::plugin::Error;
using meshrun::plugin::guard;
using meshrun::plugin::HostServicesOnly;

Communicator& communicator_of(meshrun_communicator* handle, const char* op) {
  if (handle == nullptr) {
    throw Error(MESHRUN_INVALID_ARGUMENT, std::string("nccl ") + op + ": communicator is NULL");
  }
  return *reinterpret_cast<Communicator*>(handle);
}

const Communicator& communicator_of(const meshrun_communicator* handle, const char* op) {
  return communicator_of(const_cast<meshrun_communicator*>(handle), op);
}

Request& request_of(meshrun_request* handle, const char* op) {
  if (handle == nullptr) {
    throw Error(MESHRUN_INVALID_ARGUMENT, std::string("nccl ") + op + ": request is NULL");
  }
  return *reinterpret_cast<Request*>(handle);
}

// Hands the request to the caller, or, for the blocking form (NULL
// out_request), completes it here. A blocking call whose wait fails releases
// the request: its event is freed by CUDA once the stream passes it.
void finish(std::unique_ptr<Request> request, meshrun_request** out_request) {
  if (out_request != nullptr) {
    *out_request = reinterpret_cast<meshrun_request*>(request.release());
  } else {
    request->wait(-1.0);
  }
}

meshrun_error* world(meshrun_plugin_instance* instance, const meshrun_bootstrap* bootstrap,
                     const meshrun_comm_options* options, meshrun_communicator** out) {
  return guard([&] {
    if (instance == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl world: instance is NULL");
    if (out == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl world: out is NULL");
    if (bootstrap == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "nccl world: bootstrap is NULL; the nccl backend cannot find its peers by "
                  "itself and needs the host's bootstrap (e.g. from the mpi backend) to share "
                  "NCCL's unique id");
    }
    if (bootstrap->struct_size < MESHRUN_STRUCT_SIZE(meshrun_bootstrap, broadcast) ||
        bootstrap->broadcast == nullptr) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "nccl world: the bootstrap has no broadcast function (struct_size " +
                      std::to_string(bootstrap->struct_size) + ")");
    }
    if (options == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl world: options is NULL");
    if (options->struct_size < MESHRUN_STRUCT_SIZE(meshrun_comm_options, device_id)) {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "nccl world: options too small: struct_size " +
                      std::to_string(options->struct_size) + " < " +
                      std::to_string(MESHRUN_STRUCT_SIZE(meshrun_comm_options, device_id)));
    }
    const auto& host = reinterpret_cast<HostServicesOnly*>(instance)->host();
    *out = reinterpret_cast<meshrun_communicator*>(
        Communicator::world(host, *bootstrap, *options).release());
  });
}

meshrun_error* split(meshrun_communicator* parent, int64_t color, int64_t key, const char* name,
                     meshrun_communicator** out) {
  return guard([&] {
    Communicator& communicator = communicator_of(parent, "split");
    if (name == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl split: name is NULL");
    if (out == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl split: out is NULL");
    *out = reinterpret_cast<meshrun_communicator*>(communicator.split(color, key, name).release());
  });
}

void communicator_destroy(meshrun_communicator* communicator) {
  delete reinterpret_cast<Communicator*>(communicator);
}

meshrun_error* rank(const meshrun_communicator* communicator, int64_t* out_rank) {
  return guard([&] {
    const Communicator& self = communicator_of(communicator, "rank");
    if (out_rank == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl rank: out_rank is NULL");
    *out_rank = self.rank();
  });
}

meshrun_error* size(const meshrun_communicator* communicator, int64_t* out_size) {
  return guard([&] {
    const Communicator& self = communicator_of(communicator, "size");
    if (out_size == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl size: out_size is NULL");
    *out_size = self.size();
  });
}

meshrun_error* set_stream(meshrun_communicator* communicator, void* stream) {
  return guard([&] {
    communicator_of(communicator, "set_stream").set_stream(static_cast<cudaStream_t>(stream));
  });
}

meshrun_error* all_reduce(meshrun_communicator* communicator, const DLTensor* send, DLTensor* recv,
                          int32_t op, meshrun_request** out_request) {
  return guard([&] {
    finish(communicator_of(communicator, "all_reduce").all_reduce(send, recv, op), out_request);
  });
}

meshrun_error* all_gather(meshrun_communicator* communicator, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out_request) {
  return guard([&] {
    finish(communicator_of(communicator, "all_gather").all_gather(send, recv), out_request);
  });
}

meshrun_error* reduce_scatter(meshrun_communicator* communicator, const DLTensor* send,
                              DLTensor* recv, int32_t op, meshrun_request** out_request) {
  return guard([&] {
    finish(communicator_of(communicator, "reduce_scatter").reduce_scatter(send, recv, op),
           out_request);
  });
}

meshrun_error* all_to_all(meshrun_communicator* communicator, const DLTensor* send,
                          const int64_t* send_counts, DLTensor* recv, const int64_t* recv_counts,
                          meshrun_request** out_request) {
  return guard([&] {
    finish(communicator_of(communicator, "all_to_all")
               .all_to_all(send, send_counts, recv, recv_counts),
           out_request);
  });
}

meshrun_error* broadcast(meshrun_communicator* communicator, DLTensor* tensor, int64_t root,
                         meshrun_request** out_request) {
  return guard([&] {
    finish(communicator_of(communicator, "broadcast").broadcast(tensor, root), out_request);
  });
}

meshrun_error* send(meshrun_communicator* communicator, const DLTensor* tensor, int64_t peer,
                    int64_t tag, meshrun_request** out_request) {
  return guard(
      [&] { finish(communicator_of(communicator, "send").send(tensor, peer, tag), out_request); });
}

meshrun_error* recv(meshrun_communicator* communicator, DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out_request) {
  return guard(
      [&] { finish(communicator_of(communicator, "recv").recv(tensor, peer, tag), out_request); });
}

meshrun_error* barrier(meshrun_communicator* communicator, meshrun_request** out_request) {
  return guard([&] { finish(communicator_of(communicator, "barrier").barrier(), out_request); });
}

meshrun_error* wait(meshrun_request* request, double timeout_seconds) {
  return guard([&] { request_of(request, "wait").wait(timeout_seconds); });
}

meshrun_error* test(meshrun_request* request, int32_t* out_done) {
  return guard([&] {
    Request& self = request_of(request, "test");
    if (out_done == nullptr) throw Error(MESHRUN_INVALID_ARGUMENT, "nccl test: out_done is NULL");
    *out_done = self.test() ? 1 : 0;
  });
}

void request_destroy(meshrun_request* handle) {
  if (handle == nullptr) return;
  auto* request = reinterpret_cast<Request*>(handle);
  // Nothing may escape a void entry point: a failure to settle is logged by
  // settle() itself, and the request is released either way.
  meshrun_error_release(guard([&] { request->settle(); }));
  delete request;
}

const meshrun_comm_api kCommApi = {
    .struct_size = sizeof(meshrun_comm_api),
    .device_type = kDLCUDA,
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
    .name = "nccl",
    .version = MESHRUN_PLUGIN_VERSION,
    .description =
        "NCCL: collectives and point-to-point transfers of CUDA tensors (float32, "
        "bfloat16, float16, int32, int64), one ncclComm_t per mesh axis split from "
        "the world, work ordered on the caller's CUDA stream",
    .create = &meshrun::plugin::create_instance<HostServicesOnly>,
    .destroy = &meshrun::plugin::destroy_instance<HostServicesOnly>,
    .strategy = nullptr,
    .schedule = nullptr,
    .sidecar = nullptr,
    .comm = &kCommApi,
    .extensions = nullptr,
    .model = nullptr,
};

}  // namespace

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &kApi; }
