// `meshrun train` outside the CLI's argument handling: the checks made once
// before any rank starts, and the work of one rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "config/config.hpp"
#include "plan/plan.hpp"
#include "state/state_device.hpp"
#include "train/loop.hpp"
#include "train/rank_worlds.hpp"
#include "train/throughput.hpp"

namespace meshrun::train {

// Everything about the input that can fail without starting ranks: the data
// file and its size against data.seq_len, the batch sizes against the
// data-parallel size of `plan`, whether the strategy can train, the model,
// the checkpoints to start from, the comm plugins (check_comm_plugins), and
// for a CUDA run whether this machine has a GPU (mesh/device.hpp) for each
// of `ranks_per_node` ranks a node.
// Throws input errors naming the key.
void check_training_input(const Config& config, const Plan& plan, int64_t ranks_per_node = 1);

// Whether `loader` finds the comm plugins the ranks will join through:
// comm.backend's, and for a CUDA run MPI's too (the trainer's host world).
// Throws the input error naming comm.backend or dist_env.backend, the
// plugins there are and the folders searched.
void check_comm_plugins(const Config& config, const PluginLoader& loader);

// One rank over two worlds of the same ranks in the same order:
// `host_world` carries the trainer's own collectives on host memory (the
// loss, the gradient norm's shares, validation sums, checkpoints, the
// export, the output folder's name), and `state_world` those on
// `device.state`'s memory (the strategies', whose axes' collectives it puts
// on device.comm_stream, the model's tp, cp and ep, and with a pipeline the
// executor's transfers over pp, which it puts on the state's own stream).
// On the CPU both are one communicator; a GPU run's state world is NCCL's,
// started from MPI's. Errors as train_in_process's.
void train_in_worlds(const Config& config, const std::optional<std::string>& output_dir,
                     const GemmPeakMeter& gemm_peak, Communicator& host_world,
                     Communicator& state_world, const RankDevice& device,
                     const StepObserver& observer);

// One rank: joins the world through config.comm.backend, builds the mesh,
// the model and the strategy, and trains into `output_dir` (when absent,
// runs/<rank 0's start time>); mfu divides by what `gemm_peak` measures.
// A CUDA run joins through "mpi" for the trainer's host memory and starts
// config.comm.backend's world (nccl) from it on the rank's GPU (GPU
// local_rank % the GPUs the process sees), for the state's memory.
// Returns the rank's exit status: 0, or 1
// when a step was not finite (every rank stops there alike; rank 0 says
// why). Other errors after the world exists end the rank through
// launch::abort_rank, so mpirun stops the others.
int train_rank(const Config& config, const std::optional<std::string>& output_dir,
               const GemmPeakMeter& gemm_peak);

// One rank of the same run inside a host's own process, in the world the
// host joined (the host API's meshrun_run_train; a CPU backend's world):
// checks the input as `meshrun train` does before its ranks start, then
// trains as train_rank, calling `observer` (may be empty) after each step.
// A CUDA run's state lives on the rank's GPU and moves over `gpu_world`,
// the comm backend's world the host started from `world` on that GPU
// (Job::world), or, when null, one started here. Errors are thrown, never
// a process exit: input errors naming the key, NonFiniteStep when a step
// stops the run, a peer's failure past the comm timeout.
void train_in_process(const Config& config, const std::optional<std::string>& output_dir,
                      const GemmPeakMeter& gemm_peak, Communicator& world,
                      const StepObserver& observer, Communicator* gpu_world = nullptr);

}  // namespace meshrun::train
