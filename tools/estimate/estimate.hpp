// `meshrun plan --estimate`: what a run of the plan would hold per rank and
// how long its step would take on given hardware, before any rank starts.
// docs/plan.md ("Estimates") has the rules and what they were checked
// against.
//
// Memory is the rank that holds the most (the largest pipeline stage):
// parameters, gradients and AdamW moments as the strategy predicts them
// (its plan_memory), units gathered during a step, and the activations the
// model describes (its description's "activations") for the microbatches
// the schedule holds at its peak, with and without checkpointing. The step
// time is compute (matmul FLOPs at the hardware's GEMM rate, or on
// cpu-this-machine the model's own GEMM shapes timed here; the element-wise
// passes and the optimizer at its memory bandwidth), the communication the
// strategy and tensor parallelism cannot hide behind it, and the pipeline
// schedule's bubble from its own simulation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "plan/plan.hpp"

namespace meshrun {

// A machine's capacity per rank (one GPU, or one rank's share of the CPU
// cores): what --hardware names.
struct HardwareProfile {
  std::string name;
  double matmul_flops_float32 = 0;   // FLOP/s large GEMMs sustain, float32 operands
  double matmul_flops_bfloat16 = 0;  // the same, bfloat16 operands
  double memory_bandwidth = 0;       // bytes/s of element-wise passes
  double memory_bytes = 0;           // what a rank may hold
  double intra_node_busbw = 0;       // bytes/s, collectives within a node (nccl-tests busbw)
  double inter_node_busbw = 0;       // bytes/s, collectives spanning nodes, per rank
  int64_t ranks_per_node = 1;
  // Whether communication runs beside compute (a GPU's copy engines and
  // spare SMs); on CPU cores the ranks copy with the cores they compute on.
  bool overlaps_communication = true;
  // cpu-this-machine: the model's own GEMMs (its description's flops.gemms)
  // are timed here, one core's worth, of which a rank gets core_share;
  // otherwise every matmul FLOP runs at the rates above.
  bool times_model_gemms = false;
  double core_share = 1.0;
};

// The profile `name` names: "h100-sxm", "h200", "cpu-this-machine"
// (measured now: GEMM rate and memcpy bandwidth of this machine's cores,
// shared by `ranks_per_node` ranks), or a .toml file of the fields above
// (docs/plan.md). `ranks_per_node` > 0 replaces the profile's. Throws
// INVALID_ARGUMENT naming the name, or the file's key and position.
HardwareProfile hardware_profile(const std::string& name, int64_t ranks_per_node);

struct MemoryEstimate {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t buffers = 0;  // held between steps + units gathered during a step
  // Per checkpointing mode ("none", "selective", "full"), the peak
  // activations; nullopt when the model does not describe them.
  std::optional<int64_t> activations_none, activations_selective, activations_full;
  std::string checkpointing;      // the plan's mode: "none", "selective" or "full"
  int64_t microbatches_held = 1;  // at the schedule's peak
  int64_t total() const;          // with the plan's checkpointing
};

struct TimeEstimate {
  double compute = 0;  // seconds: matmuls + element-wise + optimizer
  double matmul = 0, elementwise = 0, optimizer = 0;
  double communication = 0;  // all of it
  double exposed_communication = 0;
  double bubble = 0;  // pipeline idle, seconds
  double bubble_fraction = 0;
  double step = 0;          // compute + exposed communication + bubble
  double tokens_per_s = 0;  // the whole job's
  double mfu = 0;           // model FLOPs / (step x ranks x GEMM rate)
};

struct Estimate {
  HardwareProfile hardware;
  MemoryEstimate memory;
  TimeEstimate time;
  std::string matmul_dtype;
  double flops_per_token = 0;
  int64_t tokens_per_step = 0;
  int64_t nodes = 1;
};

// Throws INVALID_ARGUMENT when the plan has no model.
Estimate estimate_run(const Plan& plan, const HardwareProfile& hardware);

std::string estimate_to_text(const Estimate& estimate);
nlohmann::ordered_json estimate_to_json(const Estimate& estimate);

}  // namespace meshrun
