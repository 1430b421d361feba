// The pipeline executor: runs one rank's actions of a lowered schedule
// (core/schedule: compute plus SEND/RECV) for one training step.
//
// Receives are posted when the schedule says and waited for only by the
// compute that consumes them, so a transfer overlaps whatever the rank
// does meanwhile; sends are posted and left in flight, their buffers held
// until they complete. Activations between two stages of this rank are
// handed over in place. Every (kind, stage, microbatch) buffer lives from
// its producer to its consumer (trainer/pipeline/buffers.hpp), and the step
// ends when every request has completed.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "pipeline/buffers.hpp"
#include "pipeline/stage_work.hpp"
#include "schedule/schedule.hpp"

namespace meshrun::pipeline {

// A stage this rank holds: its compute and, with a sharded data-parallel
// strategy, the sharding work of its UNSHARD, RESHARD and REDUCE_GRAD
// actions (null: those actions do nothing, as with DDP).
struct HeldStage {
  StageWork& work;
  StageSharding* sharding = nullptr;
};

// Where one step's wall time went on this rank.
struct StepTimes {
  double wall_s = 0;      // the whole of run_step
  double compute_s = 0;   // F, B, I and W
  double wait_s = 0;      // blocked on receives and, at the end, on every request
  double sharding_s = 0;  // UNSHARD, RESHARD and REDUCE_GRAD
  // The share of the step this rank spent not computing: 1 - compute / wall.
  double idle_share() const { return wall_s > 0 ? 1.0 - compute_s / wall_s : 0.0; }
};

class Executor {
 public:
  // `lowered`: every rank's actions with their communication; this rank
  // runs row `rank`. `pp` is the pipeline axis' communicator (its rank r
  // runs row r); it must outlive the executor, and so must every stage.
  // Throws INVALID_ARGUMENT, naming the rank, step and action, for a
  // schedule this rank cannot run: an action for a stage it does not hold,
  // a transfer past either end of the pipeline or between two stages of
  // this rank, or stages of this rank whose activation sizes differ.
  // `pool_received` keeps received buffers for reuse (ActivationBuffers).
  // The buffers handed to the stages, and sent and received over `pp`, are
  // memory of `device`. On a GPU, `pp`'s transfers must be ordered on the
  // stream the stages compute on (the device's): a send then follows the
  // compute that made its buffer, and a receive precedes the compute that
  // reads it, without events. The schedule's validation (blocking transfers
  // matched in order between each pair of ranks) is what makes that
  // deadlock-free and lets a backend that ignores tags, as NCCL does, pair
  // every transfer right.
  Executor(schedule::Schedule lowered, int64_t rank, Communicator& pp,
           std::map<int64_t, HeldStage> stages, bool pool_received = false,
           StateDevice& device = host_state_device());
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs this rank's actions in order, then waits for every request.
  // Errors (the stage's, the comm backend's, a schedule that consumes what
  // was never produced or leaves activations behind) carry the rank, step
  // step and action.
  StepTimes run_step();

  // Buffers held now (none between steps) and the most held at once in the
  // last step, in count and bytes.
  int64_t live_buffers() const { return buffers_.live(); }
  int64_t peak_buffers() const { return buffers_.peak(); }
  int64_t peak_buffer_bytes() const { return buffers_.peak_bytes(); }
  // Bytes of received buffers kept for reuse, and buffers allocated so far.
  int64_t pooled_buffer_bytes() const { return buffers_.pooled_bytes(); }
  int64_t buffer_allocations() const { return buffers_.allocations(); }

 private:
  // A transfer in flight, and the action that started it (for its errors).
  struct InFlight {
    Request request;
    BufferKey buffer;
    size_t step = 0;
  };

  void check_schedule() const;
  void check_action(size_t step, const schedule::Action& action) const;
  void check_neighbours() const;
  std::string where(size_t step) const;

  void run_action(size_t step, const schedule::Action& action, StepTimes& times);
  void forward(const schedule::Action& action, StepTimes& times);
  void backward(const schedule::Action& action, StepTimes& times);
  void send(size_t step, const schedule::Action& action);
  void receive(size_t step, const schedule::Action& action);
  void shard(const schedule::Action& action, StepTimes& times);

  float* take_input(const BufferKey& key, StepTimes& times);
  void hand_over(const BufferKey& produced, int32_t consumer, BufferKind kind);
  void release_sent();
  void finish(StepTimes& times);
  void check_released();

  StageWork& work(int32_t stage) const { return stages_.at(stage).work; }
  bool holds(int64_t stage) const { return stages_.contains(stage); }
  int64_t tag(int32_t edge, int32_t microbatch, bool backward) const;

  schedule::Schedule schedule_;
  int64_t rank_;
  Communicator& pp_;
  std::map<int64_t, HeldStage> stages_;
  ActivationBuffers buffers_;
  std::map<BufferKey, InFlight> receives_;
  std::vector<InFlight> sends_;
  std::set<BufferKey> sent_;  // this step's, to refuse a second send
};

}  // namespace meshrun::pipeline
