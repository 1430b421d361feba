#include "model/counted_comm.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>
#include <utility>

#include "comm/comm.hpp"
#include "meshrun/host.h"
#include "plugin/loader.hpp"
#include "trace/trace.hpp"

namespace meshrun {

// The handle the model holds: the backend's communicator, its size and the
// counts. Not file-local: CountedCommunicators::Tables holds three.
struct CountedCommunicators::Counted {
  const meshrun_comm_api* backend;
  meshrun_communicator* real;
  const char* traced_as = "";  // the trace's name of its waits
  int64_t size = 1;
  int64_t rank = 0;
  int64_t bytes = 0;
  double wait_seconds = 0;  // the model blocked in `wait` on its requests
};

namespace {

using Counted = CountedCommunicators::Counted;

// The request the model holds: the backend's, and whose it is, so that a
// wait counts against its communicator.
struct CountedRequest {
  meshrun_request* real;
  Counted* owner;
};

CountedRequest* of(meshrun_request* request) { return reinterpret_cast<CountedRequest*>(request); }

Counted* of(meshrun_communicator* handle) { return reinterpret_cast<Counted*>(handle); }
const Counted* of(const meshrun_communicator* handle) {
  return reinterpret_cast<const Counted*>(handle);
}

// Wraps the request an operation of `c` returned in *out.
meshrun_error* owned(meshrun_communicator* c, meshrun_error* error, meshrun_request** out) {
  if (error == nullptr && out != nullptr && *out != nullptr) {
    *out = reinterpret_cast<meshrun_request*>(new CountedRequest{*out, of(c)});
  }
  return error;
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
  return owned(c, of(c)->backend->all_reduce(of(c)->real, send, recv, op, out), out);
}
meshrun_error* all_gather(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                          meshrun_request** out) {
  of(c)->bytes += (of(c)->size - 1) * bytes_of(send);
  return owned(c, of(c)->backend->all_gather(of(c)->real, send, recv, out), out);
}
meshrun_error* reduce_scatter(meshrun_communicator* c, const DLTensor* send, DLTensor* recv,
                              int32_t op, meshrun_request** out) {
  of(c)->bytes += (of(c)->size - 1) * bytes_of(send) / of(c)->size;
  return owned(c, of(c)->backend->reduce_scatter(of(c)->real, send, recv, op, out), out);
}
meshrun_error* broadcast(meshrun_communicator* c, DLTensor* tensor, int64_t root,
                         meshrun_request** out) {
  of(c)->bytes += bytes_of(tensor);
  return owned(c, of(c)->backend->broadcast(of(c)->real, tensor, root, out), out);
}
meshrun_error* send(meshrun_communicator* c, const DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out) {
  of(c)->bytes += bytes_of(tensor);
  return owned(c, of(c)->backend->send(of(c)->real, tensor, peer, tag, out), out);
}
meshrun_error* recv(meshrun_communicator* c, DLTensor* tensor, int64_t peer, int64_t tag,
                    meshrun_request** out) {
  return owned(c, of(c)->backend->recv(of(c)->real, tensor, peer, tag, out), out);
}
// What leaves the rank: every block but its own.
meshrun_error* all_to_all(meshrun_communicator* c, const DLTensor* send, const int64_t* send_counts,
                          DLTensor* recv, const int64_t* recv_counts, meshrun_request** out) {
  if (send != nullptr && send_counts != nullptr) {
    for (int64_t r = 0; r < of(c)->size; ++r) {
      if (r != of(c)->rank) of(c)->bytes += send_counts[r] * send->dtype.bits / 8;
    }
  }
  return owned(
      c, of(c)->backend->all_to_all(of(c)->real, send, send_counts, recv, recv_counts, out), out);
}
meshrun_error* barrier(meshrun_communicator* c, meshrun_request** out) {
  return owned(c, of(c)->backend->barrier(of(c)->real, out), out);
}

meshrun_error* wait(meshrun_request* request, double timeout_seconds) {
  const auto start = std::chrono::steady_clock::now();
  CountedRequest* counted = of(request);
  meshrun_error* error = counted->owner->backend->wait(counted->real, timeout_seconds);
  const auto end = std::chrono::steady_clock::now();
  counted->owner->wait_seconds += std::chrono::duration<double>(end - start).count();
  trace::Trace& trace = trace::Trace::process();
  if (trace.on()) trace.span(counted->owner->traced_as, trace::kCommSpan, start, end);
  return error;
}
meshrun_error* test(meshrun_request* request, int32_t* out_done) {
  return of(request)->owner->backend->test(of(request)->real, out_done);
}
void request_destroy(meshrun_request* request) {
  if (request == nullptr) return;
  of(request)->owner->backend->request_destroy(of(request)->real);
  delete of(request);
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
  for (auto [counted, real, traced_as] : {std::tuple{&tables_->tp, tp, "tp wait"},
                                          {&tables_->cp, cp, "cp wait"},
                                          {&tables_->ep, ep, "ep wait"}}) {
    *counted = {backend, real, traced_as};
    if (real == nullptr) continue;
    throw_if_error(backend->size(real, &counted->size), "comm size");
    throw_if_error(backend->rank(real, &counted->rank), "comm rank");
  }
  meshrun_comm_api& api = tables_->api;
  std::memcpy(&api, backend, std::min(backend->struct_size, sizeof(api)));
  api.struct_size = sizeof(api);
  api.all_to_all = MESHRUN_HAS_FIELD(meshrun_comm_api, backend, all_to_all) ? &all_to_all : nullptr;
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
  api.wait = &wait;
  api.test = &test;
  api.request_destroy = &request_destroy;
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

namespace {

CommTraffic take_traffic(Counted& counted) {
  return {std::exchange(counted.bytes, 0), std::exchange(counted.wait_seconds, 0.0)};
}

}  // namespace

CommTraffic CountedCommunicators::take_cp_traffic() { return take_traffic(tables_->cp); }
CommTraffic CountedCommunicators::take_ep_traffic() { return take_traffic(tables_->ep); }

}  // namespace meshrun
