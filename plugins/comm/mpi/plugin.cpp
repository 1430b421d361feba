// The mpi comm plugin (meshrun_comm_mpi.so): the ABI of meshrun/comm.h on
// MPI, for CPU tensors. Every entry point checks its arguments on the
// caller's thread (so a bad call fails at once, on this rank only) and hands
// the operation to the engine (engine.hpp), which runs it on the one thread
// that calls MPI.
#include <climits>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "arguments.hpp"
#include "collectives.hpp"
#include "communicator.hpp"
#include "engine.hpp"
#include "meshrun/plugin.hpp"
#include "point_to_point.hpp"

namespace meshrun::mpi {
namespace {

using meshrun::plugin::Error;
using meshrun::plugin::guard;

// The plugin instance. MPI starts with its first world(), so that creating
// and destroying an instance (as `meshrun plugins` and the conformance suite
// do) never touches MPI.
class Backend {
 public:
  explicit Backend(const meshrun_host_services&) {}

  std::shared_ptr<Engine> engine() {
    std::lock_guard lock(mutex_);
    if (!engine_) engine_ = Engine::acquire();
    return engine_;
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<Engine> engine_;
};

// What a meshrun_communicator handle points to. Holding the engine keeps MPI
// alive until the last communicator is gone.
struct Communicator {
  std::shared_ptr<Engine> engine;
  std::shared_ptr<Comm> comm;
};

// What a meshrun_request handle points to.
struct Request {
  std::shared_ptr<Engine> engine;
  std::shared_ptr<Completion> completion;
  std::string what;
  double default_timeout;  // the world's; <= 0: none

  // Waits up to the world's timeout; returns "" once complete, else why not.
  // After one operation has run past that timeout the job is broken: no
  // other is waited for again, so a rank giving up leaves within its first
  // timeout instead of one more per request it drops.
  std::string settle() const {
    const std::string earlier = engine->timed_out();
    if (!earlier.empty()) {
      if (completion->wait_for(0.0)) return {};
      return "was not waited for: " + earlier + " ran past the world's timeout before it";
    }
    if (completion->wait_for(default_timeout <= 0 ? -1.0 : default_timeout)) return {};
    engine->note_timed_out(what);
    return "did not complete within " + seconds_text(default_timeout) + " s (the world's timeout)";
  }

  // timeout < 0: the world's.
  void wait(double timeout_seconds) const {
    std::string unfinished;
    if (timeout_seconds < 0) {
      unfinished = settle();
    } else if (!completion->wait_for(timeout_seconds)) {
      unfinished = "did not complete within " + seconds_text(timeout_seconds) + " s";
    }
    if (!unfinished.empty()) {
      throw Error(MESHRUN_DEADLINE_EXCEEDED, what + " " + unfinished + "; it is still in flight");
    }
    completion->rethrow_failure();
  }
};

const Communicator& communicator_of(const meshrun_communicator* handle, const char* op) {
  if (handle == nullptr) invalid(op, "communicator is NULL");
  return *reinterpret_cast<const Communicator*>(handle);
}

Request& request_of(meshrun_request* handle, const char* op) {
  if (handle == nullptr) invalid(op, "request is NULL");
  return *reinterpret_cast<Request*>(handle);
}

// Queues `work`; hands out its request, or waits for it (with the world's
// timeout) when the caller wants none.
void start(const Communicator& communicator, std::string what, Work work,
           meshrun_request** out_request) {
  auto completion = communicator.engine->submit(what, std::move(work));
  auto request =
      std::make_unique<Request>(Request{communicator.engine, std::move(completion), std::move(what),
                                        communicator.comm->timeout_seconds});
  if (out_request != nullptr) {
    *out_request = reinterpret_cast<meshrun_request*>(request.release());
    return;
  }
  request->wait(-1.0);
}

// start() for work that leaves nothing in flight.
void start_collective(const Communicator& communicator, std::string what,
                      std::function<void(Scratch&)> body, meshrun_request** out_request) {
  Work work = [body = std::move(body)](Scratch& scratch) {
    body(scratch);
    return std::vector<MPI_Request>{};
  };
  start(communicator, std::move(what), std::move(work), out_request);
}

// Makes a communicator on the engine thread (collectively) and waits for it.
meshrun_communicator* create(std::shared_ptr<Engine> engine, const std::string& what,
                             double timeout_seconds, std::function<std::shared_ptr<Comm>()> make) {
  auto made = std::make_shared<std::shared_ptr<Comm>>();
  const Request request{engine,
                        engine->submit(what,
                                       [made, make = std::move(make)](Scratch&) {
                                         *made = make();
                                         return std::vector<MPI_Request>{};
                                       }),
                        what, timeout_seconds};
  request.wait(-1.0);
  return reinterpret_cast<meshrun_communicator*>(
      new Communicator{std::move(engine), std::move(*made)});
}

meshrun_error* world(meshrun_plugin_instance* instance, const meshrun_bootstrap*,
                     const meshrun_comm_options* options, meshrun_communicator** out) {
  return guard([&] {
    if (instance == nullptr) invalid("world", "instance is NULL");
    if (options == nullptr) invalid("world", "options is NULL");
    if (out == nullptr) invalid("world", "out is NULL");
    if (!MESHRUN_HAS_FIELD(meshrun_comm_options, options, timeout_seconds)) {
      invalid("world", "options too small: struct_size " + std::to_string(options->struct_size));
    }
    auto engine = reinterpret_cast<Backend*>(instance)->engine();
    const double timeout = options->timeout_seconds;
    engine->note_timeout(timeout);
    *out = create(std::move(engine), "world (MPI_Comm_dup of MPI_COMM_WORLD)", timeout,
                  [timeout] { return make_world(timeout); });
  });
}

meshrun_error* split(meshrun_communicator* parent, int64_t color, int64_t key, const char* name,
                     meshrun_communicator** out) {
  return guard([&] {
    const Communicator& from = communicator_of(parent, "split");
    const std::string what = describe("split", *from.comm);
    if (name == nullptr) invalid(what, "name is NULL");
    if (out == nullptr) invalid(what, "out is NULL");
    const int mpi_color = bounded_int(color, INT_MAX, what, "color");
    const int mpi_key = bounded_int(key, INT_MAX, what, "key");
    *out = create(from.engine, what, from.comm->timeout_seconds,
                  [comm = from.comm, mpi_color, mpi_key, copy = std::string(name)] {
                    return split_comm(*comm, mpi_color, mpi_key, copy);
                  });
  });
}

// MPI_Comm_free runs on the engine thread, after the communicator's queued
// work. An error cannot be returned from here, so it is dropped.
void communicator_destroy(meshrun_communicator* handle) {
  if (handle == nullptr) return;
  const std::unique_ptr<Communicator> communicator(reinterpret_cast<Communicator*>(handle));
  meshrun_error_release(guard([&] {
    start_collective(
        *communicator, describe("communicator_destroy", *communicator->comm),
        [comm = communicator->comm](Scratch&) { free_comm(*comm); }, nullptr);
  }));
}

meshrun_error* rank(const meshrun_communicator* handle, int64_t* out_rank) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "rank");
    if (out_rank == nullptr) invalid(describe("rank", *communicator.comm), "out_rank is NULL");
    *out_rank = communicator.comm->rank;
  });
}

meshrun_error* size(const meshrun_communicator* handle, int64_t* out_size) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "size");
    if (out_size == nullptr) invalid(describe("size", *communicator.comm), "out_size is NULL");
    *out_size = communicator.comm->size;
  });
}

// CPU tensors need no stream.
meshrun_error* set_stream(meshrun_communicator* handle, void*) {
  return guard([&] { communicator_of(handle, "set_stream"); });
}

meshrun_error* all_reduce(meshrun_communicator* handle, const DLTensor* send, DLTensor* recv,
                          int32_t op, meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "all_reduce");
    const std::string what = describe("all_reduce", *communicator.comm);
    const View in = view_of(send, what, "send");
    const View out = view_of(recv, what, "recv");
    const ReduceOp reduce = reduce_op_of(op, what);
    require_same_dtype(in, out, what);
    require_numel(out, "recv", in.numel, "numel(recv) = numel(send)", what);
    require_same_or_disjoint(in, out, what);
    start_collective(
        communicator, what,
        [comm = communicator.comm, buffers = Buffers{in.data, out.data, in.numel, in.dtype},
         reduce](Scratch& scratch) { mpi::all_reduce(*comm, scratch, buffers, reduce); },
        out_request);
  });
}

meshrun_error* all_gather(meshrun_communicator* handle, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "all_gather");
    const std::string what = describe("all_gather", *communicator.comm);
    const View in = view_of(send, what, "send");
    const View out = view_of(recv, what, "recv");
    require_same_dtype(in, out, what);
    const auto ranks = static_cast<size_t>(communicator.comm->size);
    require_numel(out, "recv", ranks * in.numel, "numel(recv) = size * numel(send)", what);
    start_collective(
        communicator, what,
        [comm = communicator.comm, buffers = Buffers{in.data, out.data, in.numel, in.dtype}](
            Scratch& scratch) { mpi::all_gather(*comm, scratch, buffers); },
        out_request);
  });
}

meshrun_error* reduce_scatter(meshrun_communicator* handle, const DLTensor* send, DLTensor* recv,
                              int32_t op, meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "reduce_scatter");
    const std::string what = describe("reduce_scatter", *communicator.comm);
    const View in = view_of(send, what, "send");
    const View out = view_of(recv, what, "recv");
    const ReduceOp reduce = reduce_op_of(op, what);
    require_same_dtype(in, out, what);
    const auto ranks = static_cast<size_t>(communicator.comm->size);
    require_numel(in, "send", ranks * out.numel, "numel(send) = size * numel(recv)", what);
    start_collective(
        communicator, what,
        [comm = communicator.comm, buffers = Buffers{in.data, out.data, out.numel, in.dtype},
         reduce](Scratch& scratch) { mpi::reduce_scatter(*comm, scratch, buffers, reduce); },
        out_request);
  });
}

// Per-rank element counts as the byte counts MPI takes, the packed total
// within int.
std::vector<int> byte_counts(const int64_t* counts, int ranks, const View& tensor, const char* role,
                             const std::string& what) {
  if (counts == nullptr) invalid(what, std::string(role) + "_counts is NULL");
  const auto element = static_cast<int64_t>(element_bytes(tensor.dtype));
  std::vector<int> bytes(static_cast<size_t>(ranks));
  int64_t total = 0;
  for (int r = 0; r < ranks; ++r) {
    if (counts[r] < 0) {
      invalid(what, std::string(role) + "_counts[" + std::to_string(r) + "] is negative (" +
                        std::to_string(counts[r]) + ")");
    }
    total += counts[r];
    if (total * element > INT_MAX) {
      invalid(what, std::string(role) +
                        "_counts add up to more than 2^31 - 1 bytes, the most one all_to_all of "
                        "this backend moves");
    }
    bytes[static_cast<size_t>(r)] = static_cast<int>(counts[r] * element);
  }
  require_numel(tensor, role, static_cast<size_t>(total), "numel = the sum of its counts", what);
  return bytes;
}

meshrun_error* all_to_all(meshrun_communicator* handle, const DLTensor* send,
                          const int64_t* send_counts, DLTensor* recv, const int64_t* recv_counts,
                          meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "all_to_all");
    const std::string what = describe("all_to_all", *communicator.comm);
    const View in = view_of(send, what, "send");
    const View out = view_of(recv, what, "recv");
    require_same_dtype(in, out, what);
    if (overlaps(in.data, in.bytes(), out.data, out.bytes())) {
      invalid(what, "send and recv overlap");
    }
    const int ranks = communicator.comm->size;
    AllToAllBuffers buffers{in.data, out.data, byte_counts(send_counts, ranks, in, "send", what),
                            byte_counts(recv_counts, ranks, out, "recv", what)};
    start_collective(
        communicator, what,
        [comm = communicator.comm, buffers = std::move(buffers)](Scratch&) {
          mpi::all_to_all(*comm, buffers);
        },
        out_request);
  });
}

meshrun_error* broadcast(meshrun_communicator* handle, DLTensor* tensor, int64_t root,
                         meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "broadcast");
    const std::string what = describe("broadcast", *communicator.comm);
    const View data = view_of(tensor, what, "tensor");
    const int from = rank_of(root, communicator.comm->size, what, "root");
    start_collective(
        communicator, what,
        [comm = communicator.comm, buffers = Buffers{data.data, data.data, data.numel, data.dtype},
         from](Scratch&) { mpi::broadcast(*comm, buffers, from); },
        out_request);
  });
}

// A send or a receive: checked, described and started.
meshrun_error* transfer(Direction direction, meshrun_communicator* handle, const DLTensor* tensor,
                        int64_t peer, int64_t tag, meshrun_request** out_request) {
  const bool sending = direction == Direction::send;
  const char* op = sending ? "send" : "recv";
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, op);
    const Comm& comm = *communicator.comm;
    const int other = rank_of(peer, comm.size, describe(op, comm), "peer");
    const int mpi_tag = bounded_int(tag, comm.tag_ub, describe(op, comm), "tag");
    const std::string detail = std::string(op) + (sending ? " to rank " : " from rank ") +
                               std::to_string(other) + " (tag " + std::to_string(mpi_tag) + ")";
    const std::string what = describe(detail.c_str(), comm);
    const View data = view_of(tensor, what, "tensor");
    start(
        communicator, what,
        [comm = communicator.comm, direction, data, other, mpi_tag](Scratch&) {
          return start_transfer(*comm, direction, data.data, data.bytes(), other, mpi_tag);
        },
        out_request);
  });
}

meshrun_error* send(meshrun_communicator* handle, const DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out_request) {
  return transfer(Direction::send, handle, tensor, peer, tag, out_request);
}

meshrun_error* recv(meshrun_communicator* handle, DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out_request) {
  return transfer(Direction::recv, handle, tensor, peer, tag, out_request);
}

meshrun_error* barrier(meshrun_communicator* handle, meshrun_request** out_request) {
  return guard([&] {
    const Communicator& communicator = communicator_of(handle, "barrier");
    start_collective(
        communicator, describe("barrier", *communicator.comm),
        [comm = communicator.comm](Scratch&) { mpi::barrier(*comm); }, out_request);
  });
}

meshrun_error* wait(meshrun_request* handle, double timeout_seconds) {
  return guard([&] { request_of(handle, "wait").wait(timeout_seconds); });
}

meshrun_error* test(meshrun_request* handle, int32_t* out_done) {
  return guard([&] {
    const Request& request = request_of(handle, "test");
    if (out_done == nullptr) invalid(request.what, "test: out_done is NULL");
    *out_done = request.completion->done() ? 1 : 0;
  });
}

// The completion is shared with the engine, so the request can be freed
// even when its operation never completes.
void request_destroy(meshrun_request* handle) {
  if (handle == nullptr) return;
  const std::unique_ptr<Request> request(reinterpret_cast<Request*>(handle));
  request->settle();
}

const meshrun_comm_api kCommApi = {
    sizeof(meshrun_comm_api),
    kDLCPU,
    nullptr,
    &world,
    &split,
    &communicator_destroy,
    &rank,
    &size,
    &set_stream,
    &all_reduce,
    &all_gather,
    &reduce_scatter,
    &broadcast,
    &send,
    &recv,
    &barrier,
    &wait,
    &test,
    &request_destroy,
    &all_to_all,
};

const meshrun_plugin_api kApi = {
    sizeof(meshrun_plugin_api),
    MESHRUN_ABI_VERSION_MAJOR,
    MESHRUN_ABI_VERSION_MINOR,
    MESHRUN_PLUGIN_KIND_COMM,
    "mpi",
    MESHRUN_PLUGIN_VERSION,
    "MPI backend for CPU tensors: one progress thread makes every MPI call, so requests proceed "
    "while the caller computes; point-to-point transfers are non-blocking and polled. On one node, "
    "collectives of 16 KiB and more move data straight between the ranks' buffers "
    "(process_vm_readv/writev, one copy); otherwise MPI collectives in 4 MiB pieces. 16-bit floats "
    "reduce in float32",
    &meshrun::plugin::create_instance<Backend>,
    &meshrun::plugin::destroy_instance<Backend>,
    nullptr,
    nullptr,
    nullptr,
    &kCommApi,
    nullptr,
    nullptr,
};

}  // namespace
}  // namespace meshrun::mpi

extern "C" const meshrun_plugin_api* meshrun_plugin_get_api(void) { return &meshrun::mpi::kApi; }
