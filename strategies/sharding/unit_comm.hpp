// The communication of one unit: the all-gather that unshards its
// parameters and the reduce-scatter (then, with HSDP, all-reduce) that
// reduces its gradients into the local shard. Each object is one operation
// in flight with the buffers it owns; it is started by its constructor,
// polled with done() and completed by finish().
#pragma once

#include <cstdint>
#include <string>

#include "buffer.hpp"
#include "common/precision.hpp"
#include "common/request.hpp"
#include "layout.hpp"
#include "meshrun/comm.h"

namespace meshrun::sharding {

// The dtypes of the gathers and reductions, and the casts between them.
using strategies::Dtype;
using strategies::dtype_bytes;
using strategies::flat_tensor;

// Where fsdp2 communicates.
struct Groups {
  const meshrun_comm_api* comm = nullptr;
  meshrun_communicator* shard = nullptr;      // dp_shard_cp: parameters are sharded over it
  meshrun_communicator* replicate = nullptr;  // dp_replicate: holds equal shards (HSDP)
  int64_t replicate_size = 1;
};

// What one collective moves: a block of the shard layout (a unit, or every
// unit), the shard group's size, and what messages call it ("unit 3").
struct CommPlace {
  const BlockPlace* block = nullptr;
  int64_t ranks = 1;
  std::string name;
};

class Gather {
 public:
  // Starts the all-gather of `comm`: this rank's chunk of `local` (its
  // shard), cast to `dtype` into a send buffer unless float32, every rank's
  // chunk into the receive buffer, in one all_gather over the shard group.
  // On a device that orders work after collectives, the unpacking that
  // finish() describes is enqueued right behind the collective, so that it
  // never queues behind collectives started later, into `slot` when given
  // (a double buffer's, which the gather holds until finish).
  Gather(const Groups& groups, const CommPlace& comm, const float* local, Dtype dtype,
         MemoryMeter& meter, Buffer* slot = nullptr);

  bool done();
  // Makes `full` hold the block's full buffer in float32: the receive
  // buffer itself when float32 and `full` holds nothing, else widened (or
  // copied) into what `full` holds when that is large enough. Gathered in
  // bfloat16, `received` then holds the receive buffer, the same numbers in
  // bfloat16, for matmuls that read bfloat16 operands. On the host it waits
  // for the collective first and returns an empty request; on a device it
  // waits for nothing, returns the request still in flight (the caller keeps
  // it until it completes), and the host's compute must wait for ready()
  // before it reads `full` or `received`.
  strategies::Request finish(Buffer& full, Buffer& received);
  // The event that ends the gather's work on the device (NULL on the host).
  const EventRef& ready() const { return ready_; }
  // The operation, as its errors name it.
  const std::string& what() const { return what_; }

 private:
  void unpack(Buffer& full, Buffer& received);
  void release_buffers();

  Device* device_;
  const BlockPlace* block_;
  Dtype dtype_;
  std::string what_;
  int64_t send_numel_;
  int64_t recv_numel_;
  Buffer send_;
  Buffer recv_;
  Buffer full_;      // on a device: the unpacked buffers, until finish
  Buffer received_;  // (their memory is the collective's until ready_)
  EventRef ready_;
  strategies::Request request_;  // after the buffers: destroyed first
};

class Reduction {
 public:
  // Starts the reduction of `comm`'s gradients `gradients` (float32, its
  // block's padded full buffer, padding zero): they are multiplied by
  // `scale` and cast to `dtype` (in float32 in place, and the buffer taken
  // over as the send buffer, leaving `gradients` empty) and
  // reduce-scattered over the shard group with `op`, then all-reduced with
  // `op` over the replicate group:
  // MESHRUN_REDUCE_AVG averages, and MESHRUN_REDUCE_SUM with scale 1 /
  // (shard ranks x replicas) averages by summing. A shard group of one
  // skips the reduce-scatter.
  // `local_gradients` (the local shard's gradients) receives the result
  // (see finish).
  Reduction(const Groups& groups, const CommPlace& comm, Buffer& gradients, Dtype dtype, int32_t op,
            float scale, float* local_gradients, MemoryMeter& meter);

  // True while the average over the replicate group (HSDP) is still to be
  // started.
  bool awaits_replication() const;
  // Waits for the reduce-scatter and starts the all-reduce (average) of its
  // result over the replicate group.
  void replicate();
  // True once the whole reduction is complete.
  bool done();
  // Waits, then adds the result to the block's chunk of the local
  // gradients. On a device that add is enqueued right behind the last
  // collective (its result in stream order), so finish only waits for the
  // collective and frees the buffers.
  void finish();

 private:
  void cast_into(Buffer& gradients, Buffer& into, int64_t numel, float scale);
  void start_all_reduce();
  // On a device: the add into the local gradients behind the last
  // collective, and the event that ends the buffers' use.
  void enqueue_add();
  void release_buffers();

  Device* device_;
  const Groups* groups_;
  const BlockPlace* block_;
  Dtype dtype_;
  int32_t op_;  // MESHRUN_REDUCE_AVG or MESHRUN_REDUCE_SUM
  std::string unit_name_;
  bool replicated_;
  std::string what_;  // the operation in flight
  int64_t send_numel_;
  int64_t recv_numel_;
  float* local_gradients_;
  Buffer send_;
  Buffer recv_;
  // On a device, with HSDP: the reduce-scatter, still in flight when the
  // all-reduce behind it starts.
  strategies::Request scattered_;
  strategies::Request request_;  // after the buffers: destroyed first
};

}  // namespace meshrun::sharding
