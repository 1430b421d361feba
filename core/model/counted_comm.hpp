// The communicators a model stage computes over (tp, cp, ep), handed to the
// model plugin behind a comm table of the host's that forwards every call
// to the backend and counts the bytes the model's collectives move and the
// time it waits for them, so that metrics.jsonl can show what tensor and
// context parallelism cost per step.
#pragma once

#include <cstdint>
#include <memory>

#include "meshrun/comm.h"

namespace meshrun {

// What one communicator's operations sent and how long the model waited.
struct CommTraffic {
  int64_t bytes = 0;
  double wait_seconds = 0;
};

class CountedCommunicators {
 public:
  // Wraps any of the three that is not null; `backend` is their table.
  CountedCommunicators(const meshrun_comm_api* backend, meshrun_communicator* tp,
                       meshrun_communicator* cp, meshrun_communicator* ep);
  ~CountedCommunicators();
  CountedCommunicators(const CountedCommunicators&) = delete;
  CountedCommunicators& operator=(const CountedCommunicators&) = delete;

  // What the stage setup hands the model: the host's table and handles
  // (null where the backend's were null). Valid while this object lives.
  const meshrun_comm_api* api() const;
  meshrun_communicator* tp() const;
  meshrun_communicator* cp() const;
  meshrun_communicator* ep() const;

  // Bytes the model's collectives and sends over the tp communicator sent
  // from this rank since the last call, as ring algorithms send them
  // (nccl-tests' bus bytes: an all-reduce of B bytes 2 (p-1)/p B).
  int64_t take_tp_bytes();
  // Likewise over the cp communicator (a send counts its bytes), with the
  // time the model blocked waiting for its operations: what the transfers
  // of context parallelism did not hide behind compute.
  CommTraffic take_cp_traffic();
  // Likewise over the ep communicator: an all-to-all counts the blocks it
  // sends to other ranks.
  CommTraffic take_ep_traffic();

  // The handle of one counted communicator (counted_comm.cpp).
  struct Counted;

 private:
  struct Tables;
  std::unique_ptr<Tables> tables_;
};

}  // namespace meshrun
