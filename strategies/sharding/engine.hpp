// The engine of the sharded strategies (fsdp2, megatron_fsdp): ZeRO-style
// sharding over units of the host's model, as PyTorch FSDP2 (fully_shard)
// and Megatron-FSDP compute it.
//
// Each rank keeps its shard of every parameter (layout.hpp) as float32
// master weights with their gradients, which the optimizer updates. Around a
// unit's forward and backward the unit is unsharded: its block of the shard
// is all-gathered in param_dtype into one float32 buffer of its full
// parameters, and freed again after (reshard) unless the options keep it
// for the rest of the step (ZeRO-1 and -2). After the unit's backward its
// gradients are reduce-scattered (average) in reduce_dtype over the shard
// group, then, with HSDP, all-reduced (average) over the replicate group,
// and added to the shard's gradients; deferred, a unit's full gradients
// accumulate over the micro-batches and are reduced once in the step
// (no_sync; ZeRO-1). Gathers of the next units are started early (prefetch)
// and reductions run while later units compute.
//
// The collectives move buckets: a bucket is one unit, or with
// single_bucket every unit at once; the hooks name units, and a unit's
// views are its part of its bucket's buffers.
//
// The buffers live on the comm backend's device (device.hpp): host memory,
// or a CUDA GPU, where a unit's collectives and casts run on the comm stream
// and the host's compute waits for a gather's event before the unit
// computes (meshrun/strategy.h, ABI 1.13).
//
// Every rank must start its collectives in the same order (meshrun/comm.h),
// and ranks complete requests at different times, so nothing is started
// because a request was found complete: gathers start in pre_forward and
// pre_backward, reduce-scatters in post_backward, and the HSDP all-reduces
// of the reduce-scatters started so far at the next post_backward,
// begin_micro_batch or finish_gradients, waiting for their reduce-scatter
// if need be. Completions found by polling only do local work (copies).
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "buffer.hpp"
#include "common/device.hpp"
#include "common/precision.hpp"
#include "common/request.hpp"
#include "layout.hpp"
#include "meshrun/strategy.h"
#include "unit_comm.hpp"

namespace meshrun::sharding {

// How the engine shards, gathers and reduces; each strategy reads its own
// keys into these.
struct EngineOptions {
  int64_t pp_size = 1;
  // Unset: AutoModel's heuristic (see Engine::reshards_after_forward).
  std::optional<bool> reshard_after_forward;
  // A unit stays gathered from its first use in a step to the step's end
  // (ZeRO-1 and -2: parameters are sharded for the optimizer only).
  bool keep_parameters_gathered = false;
  // Non-sync micro-batches keep their unit gradients unreduced (no_sync).
  bool defer_grad_sync = true;
  // A unit's reduction starts right after its backward, behind the units
  // that follow; otherwise at the micro-batch's end (the next
  // begin_micro_batch or finish_gradients).
  bool overlap_grad_reduce = true;
  bool prefetch = true;
  // Layer units are gathered into two buffers allocated once, alternating
  // (Megatron-FSDP's fsdp_double_buffer); needs units that reshard after
  // use and prefetch at most one unit ahead.
  bool double_buffer = false;
  // All units gathered and reduced as one bucket, in one collective each
  // (Megatron-FSDP's disable_bucketing): the bucket is gathered at the
  // step's first hook and freed after the root's backward (the last), and
  // its gradients reduced then.
  bool single_bucket = false;
  int64_t forward_prefetch_depth = 1;
  int64_t backward_prefetch_depth = 2;
  // Gradients are averaged by the collectives (MESHRUN_REDUCE_AVG), or
  // scaled by 1 / (data-parallel ranks) first and summed by them.
  bool average_in_collective = true;
  // The all-gather and the reduction dtypes.
  Dtype param_dtype = Dtype::bfloat16;
  Dtype reduce_dtype = Dtype::float32;
  // Each unit's gradients are checked before their reduction: a value that
  // is not finite ends the step with an error naming the parameter and the
  // data-parallel rank it arose on (Megatron-FSDP's report_nan_in_param_grad).
  bool report_nan_in_param_grad = false;
};

// INVALID_ARGUMENT naming the key for a value of the wrong type or range.
using OptionsParser = EngineOptions (*)(const char* options_json);
// The device of a setup whose comm backend moves CPU or CUDA tensors.
using DeviceMaker = std::unique_ptr<Device> (*)(const meshrun_strategy_setup& setup);

class Engine {
 public:
  // `name` begins messages and log lines; `parse` reads the setup's options;
  // `make_device` gives the buffers' device (the tests give one of their
  // own, to run the GPU's code paths on host memory).
  Engine(const meshrun_host_services& host, const char* name, OptionsParser parse,
         DeviceMaker make_device = &strategies::make_device)
      : host_(&host), name_(name), parse_(parse), make_device_(make_device) {}
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void setup(const meshrun_strategy_setup* setup);
  void broadcast_parameters();
  void begin_micro_batch(bool sync);
  void gradients_ready(int64_t begin, int64_t end) const;
  void finish_gradients();
  void memory(meshrun_strategy_memory* out) const;
  // A line to the host's log, beginning with the strategy's name.
  void log(int32_t level, const std::string& message) const;

  void pre_forward(int32_t unit);
  void post_forward(int32_t unit);
  void pre_backward(int32_t unit);
  void post_backward(int32_t unit);
  void unit_views(int32_t unit, DLTensor* parameters, DLTensor* gradients);
  // ABI 1.12: the unit's parameters as the bfloat16 gather received them.
  void unit_views_bfloat16(int32_t unit, DLTensor* parameters);
  void local_shard(DLTensor* parameters, DLTensor* gradients);
  void shard_segments(meshrun_shard_segment* segments, int64_t capacity, int64_t* count) const;
  void gather_parameters(DLTensor* full);
  // ABI 1.6: the local shard's elements and the double buffer.
  void plan_memory(const meshrun_strategy_plan_input* input,
                   meshrun_strategy_memory_plan* out) const;

 private:
  enum class Phase { idle, forward, backward };

  // Elements of the weights setup broadcasts at once: 4 MiB.
  static constexpr int64_t kWeightPiece = int64_t{1} << 20;

  struct Unit {
    Phase phase = Phase::idle;
    bool reshard_after_forward = false;
    int64_t numel = 0;   // of the full buffers; the views' shape
    int32_t bucket = 0;  // whose buffers hold the unit's
    int64_t offset = 0;  // of the unit's elements in the bucket's buffers
  };

  // What one all-gather and one reduction move: a unit, or every unit.
  struct Bucket {
    explicit Bucket(MemoryMeter& meter) : parameters(meter), received(meter), gradients(meter) {}
    CommPlace comm;                // its block of the layout
    int32_t anchor = 0;            // the unit whose reshard frees it and whose backward reduces it
    std::optional<Gather> gather;  // in flight
    EventRef ready;                // on a device: the last gather's end
    Buffer parameters;             // held while gathered
    Buffer received;               // the same, as gathered in bfloat16 (empty otherwise)
    Buffer gradients;              // held from the first pre_backward until reduced
  };

  Unit& enter(int32_t unit, Phase phase);
  Unit& leave(int32_t unit, Phase phase);
  void use_device(const meshrun_strategy_setup& setup);
  void check_setup_done(const char* call) const;
  Unit& unit_at(int32_t unit, const char* call);
  void check_idle(int32_t unit, const char* call) const;
  void check_gathered(int32_t unit, const char* call);
  void check_between_units(const char* call) const;
  void check_outside_step(const char* call) const;
  void shard_rank_zero_weights(const meshrun_strategy_setup& setup, const ShardLayout& layout);
  void make_units(const meshrun_strategy_setup& setup);
  void make_buckets();
  void make_slots(int64_t numel);
  Bucket& bucket_of(int32_t unit) {
    return buckets_[static_cast<size_t>(units_[static_cast<size_t>(unit)].bucket)];
  }
  bool reshards_after_forward(int32_t unit) const;
  std::vector<int32_t> forward_prefetch(int32_t unit) const;
  std::vector<int32_t> backward_prefetch(int32_t unit) const;

  void unshard(int32_t unit, const std::vector<int32_t>& prefetch);
  void start_gather(int32_t unit);
  void complete_gather(int32_t bucket);
  Buffer* slot_of(int32_t bucket);
  Buffer* held_slot(int32_t bucket);
  void free_slot(Buffer* slot, int32_t bucket);
  void reshard(int32_t unit);
  void release_bucket(int32_t bucket);
  void reshard_all();
  bool reduces_micro_batch() const;
  void reduce_held_gradients();
  void check_finite_gradients(const Bucket& bucket) const;
  void start_reduction(Bucket& bucket);
  void replicate_started();
  void finish_first_reduction();
  void poll();
  // A view of the local shard's parameters or gradients.
  DLTensor shard_tensor(const Buffer& shard);
  // Copies between the engine's buffers on its device (the comm stream).
  CopyFloats copy_on_device() const;

  const meshrun_host_services* host_;
  const char* name_;
  OptionsParser parse_;
  DeviceMaker make_device_;
  EngineOptions options_;
  Groups groups_;
  std::unique_ptr<const ShardLayout> layout_;  // set once setup succeeded
  std::vector<meshrun_shard_segment> segments_;
  std::vector<int64_t> offsets_;
  std::vector<std::string> parameter_names_;
  int64_t data_parallel_rank_ = 0;
  int32_t root_ = 0;
  std::vector<int32_t> layers_;    // the units but the root, in forward order
  std::vector<int32_t> position_;  // of each unit in layers_; -1 for the root

  // Declared before what lives on it: destroyed last.
  std::unique_ptr<Device> device_;
  // Declared before what they count. The local shard's memory is counted
  // apart: memory() reports communication and gathered buffers.
  MemoryMeter meter_;
  MemoryMeter shard_memory_;
  int64_t local_numel_ = 0;  // the local shard's shape
  Buffer shard_parameters_{shard_memory_};
  Buffer shard_gradients_{shard_memory_};
  std::vector<Unit> units_;
  std::vector<Bucket> buckets_;  // one per unit, or one (single_bucket)
  // With double_buffer: the two gather buffers, each lent to the layer unit
  // gathered into it and empty meanwhile.
  std::vector<Buffer> slots_;
  std::deque<Reduction> reductions_;  // in flight, in start order
  // On a device: gathers whose results the compute stream already waits
  // for, kept until their requests complete.
  struct Settling {
    strategies::Request request;
    std::string what;  // the operation, for its error
  };
  std::deque<Settling> settling_;
  bool in_micro_batch_ = false;
  bool sync_ = false;
};

}  // namespace meshrun::sharding
