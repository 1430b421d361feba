// `meshrun train` outside the CLI's argument handling: the checks made once
// before any rank starts, and the work of one rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "config/config.hpp"
#include "plan/plan.hpp"
#include "train/loop.hpp"
#include "train/throughput.hpp"

namespace meshrun::train {

// Everything about the input that can fail without starting ranks: the data
// file and its size against data.seq_len, the batch sizes against the
// data-parallel size of `plan`, whether the strategy can train, the model,
// the checkpoints to start from, and for a CUDA run whether this machine
// has a GPU (mesh/device.hpp) and whether the trainer can train there.
// Throws input errors naming the key.
void check_training_input(const Config& config, const Plan& plan);

// Throws an input error at dist_env.backend for a CUDA run: the trainer
// keeps parameters, gradients, optimizer state and every tensor it hands a
// model stage in host memory, which a model computing on a GPU and the
// NCCL backend cannot use. Not yet implemented: docs/testing.md says which
// GPU parts exist.
void require_host_training(const Config& config);

// One rank: joins the world through config.comm.backend, builds the mesh,
// the model and the strategy, and trains into `output_dir` (when absent,
// runs/<rank 0's start time>); mfu divides by what `gemm_peak` measures.
// Returns the rank's exit status: 0, or 1
// when a step was not finite (every rank stops there alike; rank 0 says
// why). Other errors after the world exists end the rank through
// launch::abort_rank, so mpirun stops the others.
int train_rank(const Config& config, const std::optional<std::string>& output_dir,
               const GemmPeakMeter& gemm_peak);

// One rank of the same run inside a host's own process, in the world the
// host joined (the host API's meshrun_run_train): checks the input as
// `meshrun train` does before its ranks start, then trains as train_rank,
// calling `observer` (may be empty) after each step. Errors are thrown,
// never a process exit: input errors naming the key, NonFiniteStep when a
// step stops the run, a peer's failure past the comm timeout.
void train_in_process(const Config& config, const std::optional<std::string>& output_dir,
                      const GemmPeakMeter& gemm_peak, Communicator& world,
                      const StepObserver& observer);

}  // namespace meshrun::train
