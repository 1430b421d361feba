#include "model/counted_comm.hpp"

#include <utility>

#include "comm/comm.hpp"
#include "meshrun/host.h"
#include "plugin/loader.hpp"

namespace meshrun {
namespace {

// The handle the model holds: the backend's communicator, its size and the
// count.
struct Counted {
  const meshrun_comm_api* backend;
  meshrun_communicator* real;
  int64_t size = 1;
  int64_t bytes = 0;
};

Counted* of(meshrun_communicator* handle) { return reinterpret_cast<Counted*>(handle); }
const Counted* of(const meshrun_communicator* handle) {
  return reinterpret_cast<const Counted*>(handle);
}

int64_t bytes_of(const DLTensor* tensor) {
  if (tensor == nullptr) return 0;
  int64_t numel = 1;
  for (int32_t d = 0; d < tensor->ndim; ++d) numel *= tensor->shape[d];
  return numel * tensor->dtype.bits * tensor->dtype.lanes / 8;
}

meshrun_error* split(meshrun_communicator* /*parent*/, int64_t /*color*/, int64_t /*key*/,
                     const char* /*name*/, meshrun_communicator** /*out*/) {
  return host_services().make_error(host_services().context, MESHRUN_UNIMPLEMENTED,
                                    "a model stage computes over the communicators it is given; "
                                    "it cannot split them");
}
// The host destroys the communicators it lent.
void communicator_destroy(meshrun_communicator* /*communicator*/) {}
meshrun_error* rank(const meshrun_communicator* c, int64_t* out) {
  return of(c)->backend->rank(of(c)->real, out);
}
meshrun_error* size(const meshrun_communicator* c, int64_t* out) {
  return of(c)->backend->size(of(c)->real, out);
}
meshrun_error* set_stream(meshrun_communicator* c, void* stream) {
  return of(c)->backend->set_stream(of(c)->real, stream);
}
// What a rank sends under the ring algorithms, nccl-tests' "bus bytes":
// an all-reduce of B bytes 2 (p-1)/p B, an all-gather of B bytes per rank
// (p-1) B, a reduce-scatter of B bytes in all (p-1)/p B; so sequence
// parallelism's all-gather + reduce-scatter weigh what one all-reduce does.
meshrun_error* all_reduce(meshrun_communicator* c, const DLTensor* send, DLTensor* recv, int32_t op,
                          meshrun_request** out) {
  of(c)->bytes += 2 * (of(c)->size - 1) * bytes_of(send) / of(c)->size;
  return of(c)->backend->all_reduce(of(c)->real, send, recv, op, out);
}
meshrun_error* all_gather(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out) {
  of(c)->bytes += (of(c)->size - 1) * bytes_of(send);
  return of(c)->backend->all_gather(of(c)->real, send, recv, out);
}
meshrun_error* reduce_scatter(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                              int32_t op, meshrun_request** out) {
  of(c)->bytes += (of(c)->size - 1) * bytes_of(send) / of(c)->size;
  return of(c)->backend->reduce_scatter(of(c)->real, send, recv, op, out);
}
meshrun_error* broadcast(meshrun_communicator* c, DLTensor* tensor, int64_t root,
                         meshrun_request** out) {
  of(c)->bytes += bytes_of(tensor);
  return of(c)->backend->broadcast(of(c)->real, tensor, root, out);
}
meshrun_error* send(meshrun_communicator* c, const DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out) {
  of(c)->bytes += bytes_of(tensor);
  return of(c)->backend->send(of(c)->real, tensor, peer, tag, out);
}
meshrun_error* recv(meshrun_communicator* c, DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out) {
  return of(c)->backend->recv(of(c)->real, tensor, peer, tag, out);
}
meshrun_error* barrier(meshrun_communicator* c, meshrun_request** out) {
  return of(c)->backend->barrier(of(c)->real, out);
}

}  // namespace

struct CountedCommunicators::Tables {
  meshrun_comm_api api{};
  Counted tp{}, cp{}, ep{};
  meshrun_communicator* handle(Counted& counted) const {
    return counted.real != nullptr ? reinterpret_cast<meshrun_communicator*>(&counted) : nullptr;
  }
};

CountedCommunicators::CountedCommunicators(const meshrun_comm_api* backend,
                                           meshrun_communicator* tp, meshrun_communicator* cp,
                                           meshrun_communicator* ep)
    : tables_(std::make_unique<Tables>()) {
  if (backend == nullptr) return;
  for (auto [counted, real] :
       {std::pair{&tables_->tp, tp}, {&tables_->cp, cp}, {&tables_->ep, ep}}) {
    *counted = {backend, real};
    if (real != nullptr) throw_if_error(backend->size(real, &counted->size), "comm size");
  }
  meshrun_comm_api& api = tables_->api;
  api = *backend;
  api.split = &split;
  api.communicator_destroy = &communicator_destroy;
  api.rank = &rank;
  api.size = &size;
  api.set_stream = &set_stream;
  api.all_reduce = &all_reduce;
  api.all_gather = &all_gather;
  api.reduce_scatter = &reduce_scatter;
  api.broadcast = &broadcast;
  api.send = &send;
  api.recv = &recv;
  api.barrier = &barrier;
}

CountedCommunicators::~CountedCommunicators() = default;

const meshrun_comm_api* CountedCommunicators::api() const {
  return tables_->tp.backend != nullptr ? &tables_->api : nullptr;
}
meshrun_communicator* CountedCommunicators::tp() const { return tables_->handle(tables_->tp); }
meshrun_communicator* CountedCommunicators::cp() const { return tables_->handle(tables_->cp); }
meshrun_communicator* CountedCommunicators::ep() const { return tables_->handle(tables_->ep); }

int64_t CountedCommunicators::take_tp_bytes() {
  const int64_t bytes = tables_->tp.bytes;
  tables_->tp.bytes = 0;
  return bytes;
}

}  // namespace meshrun
