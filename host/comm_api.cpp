// The host API's communicators and collectives (meshrun/host.h, ABI 1.5):
// the comm backend's operations on the caller's tensors, blocking or as an
// operation in flight.
#include <memory>
#include <vector>

#include "host_api.hpp"

namespace {

using meshrun::Communicator;
using meshrun::ReduceOp;
using meshrun::Request;
using meshrun::host_api::adopt;
using meshrun::host_api::guarded;
using meshrun::host_api::live;
using meshrun::host_api::require;

Communicator& communicator_of(meshrun_comm* comm) { return *live(comm, "comm").communicator; }

ReduceOp reduce_op(int32_t op) {
  if (op != MESHRUN_REDUCE_SUM && op != MESHRUN_REDUCE_AVG && op != MESHRUN_REDUCE_MAX) {
    throw meshrun::Error(MESHRUN_INVALID_ARGUMENT,
                         "reduction op " + std::to_string(op) +
                             " is not MESHRUN_REDUCE_SUM (0), _AVG (1) or _MAX (2)");
  }
  return static_cast<ReduceOp>(op);
}

// Completes `request` now, or hands it to the caller as an operation.
void finish(meshrun_comm* comm, Request request, meshrun_op** out_op) {
  if (out_op == nullptr) {
    request.wait();
    return;
  }
  *out_op = adopt(std::make_unique<meshrun_op>(meshrun_op{comm->job, std::move(request)}));
}

// Starts an operation with `start(communicator)` and finishes it, as host
// call `call`.
template <class Start>
meshrun_error* operation(const char* call, meshrun_comm* comm, meshrun_op** out_op, Start&& start) {
  return guarded(call, [&] { finish(comm, start(communicator_of(comm)), out_op); });
}

}  // namespace

extern "C" {

meshrun_error* meshrun_comm_rank(const meshrun_comm* comm, int64_t* out_rank) {
  return guarded(__func__, [&] {
    live(comm, "comm");
    require(out_rank, "out_rank");
    *out_rank = comm->communicator->rank();
  });
}

meshrun_error* meshrun_comm_size(const meshrun_comm* comm, int64_t* out_size) {
  return guarded(__func__, [&] {
    live(comm, "comm");
    require(out_size, "out_size");
    *out_size = comm->communicator->size();
  });
}

meshrun_error* meshrun_all_reduce(meshrun_comm* comm, const DLTensor* send, DLTensor* recv,
                                  int32_t op, meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(send, "send");
    require(recv, "recv");
    return c.all_reduce(*send, *recv, reduce_op(op));
  });
}

meshrun_error* meshrun_all_gather(meshrun_comm* comm, const DLTensor* send, DLTensor* recv,
                                  meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(send, "send");
    require(recv, "recv");
    return c.all_gather(*send, *recv);
  });
}

meshrun_error* meshrun_all_to_all(meshrun_comm* comm, const DLTensor* send,
                                  const int64_t* send_counts, DLTensor* recv,
                                  const int64_t* recv_counts, meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(send, "send");
    require(send_counts, "send_counts");
    require(recv, "recv");
    require(recv_counts, "recv_counts");
    const auto ranks = static_cast<size_t>(c.size());
    return c.all_to_all(*send, std::vector<int64_t>(send_counts, send_counts + ranks), *recv,
                        std::vector<int64_t>(recv_counts, recv_counts + ranks));
  });
}

meshrun_error* meshrun_reduce_scatter(meshrun_comm* comm, const DLTensor* send, DLTensor* recv,
                                      int32_t op, meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(send, "send");
    require(recv, "recv");
    return c.reduce_scatter(*send, *recv, reduce_op(op));
  });
}

meshrun_error* meshrun_broadcast(meshrun_comm* comm, DLTensor* tensor, int64_t root,
                                 meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(tensor, "tensor");
    return c.broadcast(*tensor, root);
  });
}

meshrun_error* meshrun_send(meshrun_comm* comm, const DLTensor* tensor, int64_t peer, int64_t tag,
                            meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(tensor, "tensor");
    return c.send(*tensor, peer, tag);
  });
}

meshrun_error* meshrun_recv(meshrun_comm* comm, DLTensor* tensor, int64_t peer, int64_t tag,
                            meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) {
    require(tensor, "tensor");
    return c.recv(*tensor, peer, tag);
  });
}

meshrun_error* meshrun_barrier(meshrun_comm* comm, meshrun_op** out_op) {
  return operation(__func__, comm, out_op, [&](Communicator& c) { return c.barrier(); });
}

meshrun_error* meshrun_op_wait(meshrun_op* op, double timeout_seconds) {
  return guarded(__func__, [&] {
    live(op, "op");
    op->request.wait(timeout_seconds);
  });
}

meshrun_error* meshrun_op_test(meshrun_op* op, int32_t* out_done) {
  return guarded(__func__, [&] {
    live(op, "op");
    require(out_done, "out_done");
    *out_done = op->request.test() ? 1 : 0;
  });
}

void meshrun_op_destroy(meshrun_op* op) {
  if (meshrun::host_api::forget_handle(op)) delete op;
}

}  // extern "C"
