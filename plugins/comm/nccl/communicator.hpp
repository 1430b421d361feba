// The nccl comm backend's objects behind the opaque handles of meshrun/comm.h.
//
// A Communicator owns one ncclComm_t on one CUDA device and the stream its
// operations are ordered on (set_stream; NULL, CUDA's legacy default stream,
// until then). Every operation is enqueued on that stream and followed by a
// CUDA event; a Request is that event, so `wait` and `test` ask CUDA whether
// the stream has passed it and ask NCCL whether a peer or the network failed.
//
// Needs NCCL >= 2.18 (ncclCommSplit); communicators run in NCCL's blocking
// mode whatever NCCL_COMM_BLOCKING says.
//
// Behaviour the ABI leaves to the backend, decided here:
// - world() makes options->device_id the calling thread's current device and
//   leaves it so: restoring the previous device would create a CUDA context
//   on device 0 in every rank of a job that never touched CUDA before.
//   Other calls switch to the communicator's device only for their own CUDA
//   calls and switch back.
// - NCCL matches a send with a recv by order alone, per communicator and
//   peer; it has no tags. A tag must be >= 0 (as MPI requires) and is
//   otherwise unused: programs must issue the sends to a peer in the order
//   that peer issues the matching recvs. Sending to oneself is refused (NCCL
//   matches that only inside one group, which the ABI has no call for).
// - Operations on one stream run in the order they were issued, and a send
//   may not complete until its recv runs: two ranks that each send to the
//   other before receiving can deadlock. Such exchanges must be ordered (one
//   side receives first); chains (0 -> 1 -> 2) need no care.
// - In place: all_reduce and broadcast use NCCL's in-place form. For
//   all_gather, send.data == recv.data means this rank's input is the first
//   numel(send) elements of recv; for reduce_scatter it means recv is the
//   first numel(recv) elements of send, and the rest of send is unspecified
//   afterwards. NCCL's own in-place layouts (send at chunk `rank` of recv,
//   recv at chunk `rank` of send) are accepted too; other overlaps are
//   refused.
// - barrier is an all-reduce of one int32 on the device: it completes when
//   every rank's stream has reached it.
// - Reductions of float16 and bfloat16 accumulate in that type (NCCL reduces
//   them natively); AVG of integers truncates toward zero (NCCL's ncclAvg).
// - One thread at a time may use a communicator and its requests (NCCL
//   communicators are not thread-safe).
#pragma once

#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "meshrun/comm.h"

namespace meshrun::nccl {

class Communicator;

// An operation in flight: the CUDA event recorded after it on the stream.
class Request {
 public:
  // Takes ownership of `event`. `op` is a string literal naming the operation.
  Request(Communicator& communicator, const char* op, cudaEvent_t event);
  ~Request();
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // Blocks until the operation completes and throws its error, if any.
  // timeout_seconds < 0 uses the world's timeout (where that is <= 0, no
  // limit); on expiry throws DEADLINE_EXCEEDED and the request stays in
  // flight.
  void wait(double timeout_seconds);
  // True once the operation has completed (successfully or not).
  bool test();
  // Waits up to the world's timeout before the request is released, logging
  // a request that is still in flight then. The operation's own error was
  // the caller's to collect and is dropped.
  void settle();

 private:
  // One look at the event and at NCCL: true when the request has completed,
  // with failure_code_ / failure_ set if it failed.
  bool poll();

  Communicator& communicator_;
  const char* op_;
  cudaEvent_t event_;
  bool done_ = false;
  int32_t failure_code_ = MESHRUN_OK;
  std::string failure_;
};

// A validated tensor: its first byte, element count and NCCL type.
struct Buffer {
  char* data = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  size_t element_bytes = 0;

  size_t bytes() const { return count * element_bytes; }
};

class Communicator {
 public:
  // Makes the world communicator; collective over the bootstrap's ranks.
  static std::unique_ptr<Communicator> world(const meshrun_host_services& host,
                                             const meshrun_bootstrap& bootstrap,
                                             const meshrun_comm_options& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Collective over this communicator (ncclCommSplit).
  std::unique_ptr<Communicator> split(int64_t color, int64_t key, const std::string& name);

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  double timeout_seconds() const { return timeout_seconds_; }
  void set_stream(cudaStream_t stream);

  std::unique_ptr<Request> all_reduce(const DLTensor* send, DLTensor* recv, int32_t op);
  std::unique_ptr<Request> all_gather(const DLTensor* send, DLTensor* recv);
  std::unique_ptr<Request> reduce_scatter(const DLTensor* send, DLTensor* recv, int32_t op);
  std::unique_ptr<Request> broadcast(DLTensor* tensor, int64_t root);
  std::unique_ptr<Request> send(const DLTensor* tensor, int64_t peer, int64_t tag);
  std::unique_ptr<Request> recv(DLTensor* tensor, int64_t peer, int64_t tag);
  std::unique_ptr<Request> barrier();
  // One ncclSend and one ncclRecv per peer with a count, in one group.
  std::unique_ptr<Request> all_to_all(const DLTensor* send, const int64_t* send_counts,
                                      DLTensor* recv, const int64_t* recv_counts);

  // "nccl all_reduce on communicator 'dp' (rank 1 of 4)": how every message
  // about an operation begins.
  std::string describe(const char* op) const;
  // The failure NCCL reports for this communicator, if any: a failed peer or
  // network. The first one aborts the communicator, after which every call
  // reports it.
  std::optional<std::pair<int32_t, std::string>> async_error();
  void log(int32_t level, const std::string& message) const;

 private:
  Communicator(const meshrun_host_services& host, ncclComm_t comm, int device, std::string name,
               double timeout_seconds);

  // Throws UNAVAILABLE when the communicator was aborted.
  void require_usable(const char* op) const;
  Buffer buffer(const DLTensor* tensor, const char* role, const char* op) const;
  void require_peer(int64_t peer, const char* role, const char* op) const;
  void require_point_to_point(int64_t peer, int64_t tag, const char* name,
                              const char* self_transfer) const;
  // Enqueues `body` on the stream, then records the request's event after it.
  template <class Body>
  std::unique_ptr<Request> launch(const char* op, Body&& body);

  const meshrun_host_services* host_;
  ncclComm_t comm_;
  int device_;
  std::string name_;
  double timeout_seconds_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
  cudaStream_t stream_ = nullptr;
  // Device memory the barrier all-reduces; its value is never read.
  int32_t* barrier_scratch_ = nullptr;
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace meshrun::nccl
