// A bootstrap (meshrun/comm.h) over a communicator of the host's: how a
// backend that cannot find its peers by itself (nccl) starts from one that
// can (mpi): rank 0's NCCL unique id, broadcast to every rank over it.
#pragma once

#include "comm/comm.hpp"
#include "meshrun/comm.h"

namespace meshrun {

class CommBootstrap {
 public:
  // `over` (a world of a backend that finds its peers, e.g. mpi's) must
  // outlive the bootstrap; its rank and size are the job's.
  explicit CommBootstrap(Communicator& over);
  CommBootstrap(const CommBootstrap&) = delete;
  CommBootstrap& operator=(const CommBootstrap&) = delete;

  // What CommBackend::world takes; valid while this object lives.
  const meshrun_bootstrap* get() const { return &bootstrap_; }

 private:
  // meshrun_bootstrap.broadcast: `bytes` at `data` on rank `root` to every
  // rank, as whole int32 words (a CPU backend moves whole elements).
  static meshrun_error* broadcast(void* context, void* data, size_t bytes, int64_t root);

  meshrun_bootstrap bootstrap_;
};

}  // namespace meshrun
