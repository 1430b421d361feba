#include "train/run.hpp"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "comm/bootstrap.hpp"
#include "comm/comm.hpp"
#include "launch/launch.hpp"
#include "mesh/device.hpp"
#include "state/input_error.hpp"
#include "strategy/strategy.hpp"
#include "train/experts.hpp"
#include "train/hooks.hpp"
#include "train/pipeline_trainer.hpp"
#include "train/rank_gpu.hpp"
#include "train/trainer.hpp"

namespace meshrun::train {
namespace {

// Checked before any rank starts, so a strategy that cannot train is an
// input error (the Strategy wrapper in the ranks refuses it too).
void check_strategy_trains(const Config& config, const PluginLibrary& strategy) {
  if (!strategy_can_train(strategy)) {
    throw config_error(
        config, "distributed.strategy",
        fmt::format("'{}' cannot train yet: its plugin {} has only the mesh rules "
                    "(no ABI 1.2 training entry points); use strategy \"fsdp2\" or \"ddp\"",
                    config.distributed.strategy, strategy.path()));
  }
  if (config.distributed.init_fsdp_with_meta_device && !strategy_takes_weights_by_shard(strategy)) {
    throw config_error(config, "distributed.init_fsdp_with_meta_device",
                       fmt::format("strategy plugin {} cannot start its shards without the whole "
                                   "model (no ABI 1.6 weights_by_shard); set it to false",
                                   strategy.path()));
  }
}

void check_batch(const Config& config, int64_t dp) {
  const TrainConfig& t = config.train;
  if (t.global_batch_size % (t.micro_batch_size * dp) != 0) {
    throw config_error(config, "train.global_batch_size",
                       fmt::format("{} is not divisible by train.micro_batch_size ({}) x the "
                                   "data-parallel size dp ({})",
                                   t.global_batch_size, t.micro_batch_size, dp));
  }
}

// Sequence parallelism shards each sequence's rows over tp ranks: every
// batch the trainer forms (a micro-batch, one validation window) has whole
// sequences, so tp dividing seq_len is what makes them all divide.
void check_sequence_parallel(const Config& config, const Plan& plan) {
  const DistributedConfig& d = config.distributed;
  if (!d.sequence_parallel) return;
  if (!plan.model->description().sequence_parallel) {
    throw config_error(config, "distributed.sequence_parallel",
                       fmt::format("model plugin {} computes tensor parallelism with its residual "
                                   "stream replicated over tp ranks only (its description has no "
                                   "\"sequence_parallel\": true); set it to false",
                                   plan.model->library().path()));
  }
  if (config.data.seq_len % d.tp_size == 0) return;
  throw config_error(config, "data.seq_len",
                     fmt::format("{} is not divisible by distributed.tp_size ({}): sequence "
                                 "parallelism shards every sequence over the tp ranks",
                                 config.data.seq_len, d.tp_size));
}

// Autocast changes what the model's own matmuls compute in, which only the
// model can do: it says so in its description.
void check_autocast(const Config& config, const Plan& plan) {
  const std::string& dtype = config.distributed.autocast_dtype;
  if (dtype.empty() || dtype == "float32") return;
  const std::vector<std::string>& supported = plan.model->description().autocast_dtypes;
  if (std::find(supported.begin(), supported.end(), dtype) != supported.end()) return;
  throw config_error(config, "distributed.autocast_dtype",
                     fmt::format("model plugin {} computes its matmuls in float32 only (its "
                                 "description's \"autocast_dtypes\" has no \"{}\"); remove the "
                                 "key or set it to \"float32\"",
                                 plan.model->library().path(), dtype));
}

// The data are bytes: the model must take every byte as a token, and
// sequences as long as data.seq_len.
void check_model_fits_data(const Config& config, const Plan& plan) {
  const ModelDescription& d = plan.model->description();
  if (d.vocab_size < 256) {
    throw config_error(config, "model.model_type",
                       fmt::format("the model's vocabulary holds {} tokens; the training data are "
                                   "bytes, which need at least 256 (vocab_size)",
                                   d.vocab_size));
  }
  if (d.max_seq_len && config.data.seq_len > *d.max_seq_len) {
    throw config_error(config, "data.seq_len",
                       fmt::format("{} is longer than the model's {} positions",
                                   config.data.seq_len, *d.max_seq_len));
  }
}

bool splits_backward(const schedule::Schedule& schedule) {
  for (const auto& rank : schedule.ranks) {
    for (const auto& action : rank) {
      if (action && action->type == schedule::ActionType::I) return true;
    }
  }
  return false;
}

// With pp > 1: the microbatches fit the batch and the schedule is valid.
void check_pipeline(const Config& config, const Plan& plan) {
  const int64_t dp = plan.mesh.axis_size(Axis::dp);
  const int64_t share = config.train.global_batch_size / dp;
  const int64_t micro = config.distributed.pipeline.pp_microbatch_size;
  if (share % micro != 0) {
    throw config_error(config, "distributed.pipeline.pp_microbatch_size",
                       fmt::format("{} does not divide a data-parallel rank's share of the batch "
                                   "(train.global_batch_size {} / dp {} = {})",
                                   micro, config.train.global_batch_size, dp, share));
  }
  const bool from_csv = !config.distributed.pipeline.pp_schedule_csv.empty();
  const char* key =
      from_csv ? "distributed.pipeline.pp_schedule_csv" : "distributed.pipeline.pp_schedule";
  schedule::Schedule schedule;
  try {
    schedule = pipeline_schedule(config, plan, config.distributed.pp_size,
                                 int64_t(plan.model_plan.at("pipeline").size()),
                                 pipeline_microbatches(config, dp));
  } catch (const Error& error) {
    throw config_error(config, key, error.what());
  }
  if (splits_backward(schedule) && !plan.model->splits_backward()) {
    throw config_error(config, key,
                       fmt::format("schedule {} splits the backward into I and W, which model "
                                   "plugin {} cannot (it has no backward_input); use gpipe, 1f1b, "
                                   "interleaved_1f1b or looped_bfs",
                                   schedule.name, plan.model->library().path()));
  }
}

// runs/<rank 0's start time>, the same on every rank.
std::string default_output_dir(Communicator& world) {
  int64_t now = std::time(nullptr);
  FlatTensor tensor(&now, dtype_int64(), 1);
  world.broadcast(tensor.get(), 0).wait();
  return fmt::format("runs/{:%Y%m%d-%H%M%S}", fmt::localtime(std::time_t(now)));
}

void announce(const Config& config, Communicator& world, const Model& model,
              const std::string& output_dir) {
  if (world.rank() != 0) return;
  std::printf(
      "meshrun train: %lld ranks, model %s, strategy %s, pp %lld, %lld parameters, "
      "output %s\n",
      static_cast<long long>(world.size()), config.model.model_type.c_str(),
      config.distributed.strategy.c_str(), static_cast<long long>(config.distributed.pp_size),
      static_cast<long long>(model.description().numel), output_dir.c_str());
  std::fflush(stdout);
}

std::vector<std::string> module_names(const ModelDescription& description) {
  std::vector<std::string> names;
  for (const auto& module : description.modules) names.push_back(module.name);
  return names;
}

// Where a rank's run writes, what its mfu divides by, and who hears of
// each step.
struct RunOutput {
  std::string dir;
  GemmPeakMeter gemm_peak;
  StepObserver observer;
};

void run_trainer(const Config& config, const Plan& plan, const TokenData& data,
                 const RankComms& comms, const RankDevice& device, const RunOutput& output,
                 const std::vector<std::string>& modules, const std::string& options,
                 std::vector<TrainPart> parts) {
  Trainer trainer({config, data, *plan.model, modules, std::move(parts), device.state,
                   comms.host_world, comms.host.axis(Axis::dp), comms.host.axis(Axis::tp),
                   computing_axes(comms.state, plan.mesh), *plan.tensor_parallel,
                   plan.model_plan.dump(), options, output.dir, output.gemm_peak, device.gpu});
  if (!config.checkpoint.resume_from.empty()) {
    trainer.resume(read_index(config, plan.model->description()));
  }
  trainer.broadcast_parameters();
  announce(config, comms.host_world, *plan.model, output.dir);
  trainer.run(output.observer);
}

// One strategy's parameters on this rank: their starting weights, units
// and strategy, which shards them over `groups` (of the state's memory).
struct RankPart {
  RankPart(const Config& config, const Plan& plan, const TensorParallelRank& tp,
           const StageContents& contents, const StrategyGroups& groups, const std::string& options,
           const RankDevice& device)
      : parameters(plan.tensor_parallel->local(), contents.parameters, device.state,
                   !config.distributed.init_fsdp_with_meta_device),
        units(stage_units(plan.tensor_parallel->local(), contents)) {
    // Megatron-FSDP's meta-device init: the weights go straight into each
    // rank's shard, and no rank holds the whole model.
    const bool by_shard = config.distributed.init_fsdp_with_meta_device;
    if (!by_shard) start_weights(config, *plan.model, tp, parameters);
    units.strategy.shard_group = &groups.shard;
    units.strategy.replicate_group = &groups.replicate;
    StrategyBuffers buffers = parameters.strategy_buffers(plan.tensor_parallel->local());
    buffers.comm_stream = device.comm_stream;
    strategy = std::make_unique<Strategy>(plan.strategy, groups.data_parallel, std::move(buffers),
                                          options, &units.strategy);
    // The strategy copied its shard: the full weights are no longer needed.
    if (strategy->sharded()) parameters.release();
    if (by_shard) start_shard_weights(config, *plan.model, tp, parameters, *strategy);
  }

  // The trainer's view: the optimizer's norm sums over `host`, the host's
  // twins of the strategy's groups.
  TrainPart train_part(const StrategyGroups& host) {
    return TrainPart{*strategy, parameters, units, host.shard, host.replicate};
  }

  FlatParameters parameters;
  StageUnits units;
  std::unique_ptr<Strategy> strategy;
};

// A mixture of experts trains its experts with a strategy instance of
// their own: over ep_shard (no replicas) with expert parallelism, else over
// the dense parameters' groups.
void train_data_parallel(const Config& config, const Plan& plan, const TokenData& data,
                         const RankComms& comms, const RankDevice& device,
                         const RunOutput& output) {
  const Model& model = *plan.model;
  const std::vector<std::string> modules = module_names(model.description());
  const TensorParallelRank tp{*plan.tensor_parallel, comms.host.axis(Axis::tp)};
  const std::string options = strategy_options_json(config.distributed);
  const StrategyGroups dense_state = dense_groups(comms.state);
  const StrategyGroups dense_host = dense_groups(comms.host);
  const bool moe = plan.mesh.has_moe() && plan.mesh.axis_size(Axis::ep) > 1;
  if (!model.description().experts || !strategy_shards(*plan.strategy)) {
    RankPart part(config, plan, tp, stage_contents(model, modules), dense_state, options, device);
    run_trainer(config, plan, data, comms, device, output, modules, options,
                {part.train_part(dense_host)});
    return;
  }
  const ExpertPlacement placement =
      moe ? ExpertPlacement{comms.host.axis(Axis::ep).rank(), comms.host.axis(Axis::ep).size()}
          : ExpertPlacement{};
  const auto [dense_contents, expert_contents] =
      split_experts(model.description(), stage_contents(model, modules, placement));
  RankPart dense(config, plan, tp, dense_contents, dense_state, options, device);
  TrainPart dense_part = dense.train_part(dense_host);
  dense_part.exports = comms.host.axis(Axis::dp).rank() == 0;
  if (!moe) {
    RankPart experts(config, plan, tp, expert_contents, dense_state, options, device);
    TrainPart expert_part = experts.train_part(dense_host);
    expert_part.exports = dense_part.exports;
    run_trainer(config, plan, data, comms, device, output, modules, options,
                {dense_part, expert_part});
    return;
  }
  ExpertGroups groups(comms, device.comm_stream);
  RankPart experts(config, plan, tp, expert_contents, groups.state(),
                   expert_options(config, options), device);
  TrainPart expert_part = experts.train_part(groups.host());
  expert_part.norm_across = &comms.host.axis(Axis::ep);
  expert_part.gradient_scale = float(1.0 / double(comms.host.axis(Axis::ep).size()));
  expert_part.exports = comms.host.axis(Axis::ep_shard).rank() == 0;
  run_trainer(config, plan, data, comms, device, output, modules, options,
              {dense_part, expert_part});
}

// The axes a strategy's collectives run over, whose stream is the comm
// stream on a GPU (the model's, tp, cp and ep, run on the compute stream:
// the model stage sets them).
std::vector<Axis> strategy_axes(const MeshContext& mesh) {
  std::vector<Axis> axes{Axis::dp, Axis::dp_shard_cp, Axis::dp_replicate};
  if (mesh.has_moe()) axes.push_back(Axis::ep_shard);
  return axes;
}

// dist_env.backend = "nccl": the state and the model on the rank's GPU, the
// strategies and the model's collectives over `gpu_world` (a world of the
// comm backend on that GPU; started from `world` when null), `world`
// keeping the trainer's host-side collectives.
void train_on_gpu(const Config& config, const std::optional<std::string>& output_dir,
                  const GemmPeakMeter& gemm_peak, Communicator& world, Communicator* gpu_world,
                  const StepObserver& observer) {
  const std::unique_ptr<RankGpu> gpu = open_rank_gpu(launched_rank_gpu(world.rank()), world.rank());
  std::optional<CommBackend> backend;
  std::optional<Communicator> started;
  if (gpu_world == nullptr) {
    backend.emplace(PluginLoader::from_environment(), config.comm.backend);
    const CommBootstrap bootstrap(world);
    started.emplace(
        backend->world(config.comm.timeout_minutes * 60.0, gpu->device(), bootstrap.get()));
    gpu_world = &*started;
  }
  train_in_worlds(config, output_dir, gemm_peak, world, *gpu_world,
                  {gpu->state(), gpu->comm_stream(), gpu.get()}, observer);
}

void train_pipeline(const Config& config, const Plan& plan, const TokenData& data,
                    const RankComms& comms, const RankDevice& device, const RunOutput& output) {
  PipelineTrainer trainer({config, data, plan, comms, device,
                           strategy_options_json(config.distributed), output.dir,
                           output.gemm_peak});
  if (!config.checkpoint.resume_from.empty()) {
    trainer.resume(read_index(config, plan.model->description()));
  }
  announce(config, comms.host_world, *plan.model, output.dir);
  trainer.run(output.observer);
}

void train_in_world(const Config& config, const std::optional<std::string>& output_dir,
                    const GemmPeakMeter& gemm_peak, Communicator& world,
                    const StepObserver& observer, Communicator* gpu_world = nullptr) {
  if (config.dist_env.on_cuda()) {
    train_on_gpu(config, output_dir, gemm_peak, world, gpu_world, observer);
  } else {
    train_in_worlds(config, output_dir, gemm_peak, world, world, {host_state_device()}, observer);
  }
}

}  // namespace

void check_comm_plugins(const Config& config, const PluginLoader& loader) {
  struct Needed {
    std::string name;
    const char* key;
    const char* why;
  };
  std::vector<Needed> needed{{config.comm.backend, "comm.backend", "the ranks join its world"}};
  if (config.dist_env.on_cuda()) {
    needed.push_back({"mpi", "dist_env.backend",
                      "\"nccl\" joins MPI's world for the trainer's host memory and starts "
                      "NCCL's from it"});
  }
  for (const auto& [name, key, why] : needed) {
    if (loader.find(PluginKind::comm, name)) continue;
    try {
      loader.load(PluginKind::comm, name);
    } catch (const Error& error) {
      throw config_error(config, key, fmt::format("{}: {}", why, error.what()));
    }
  }
}

void check_training_input(const Config& config, const Plan& plan, int64_t ranks_per_node) {
  const TokenData data(config);
  check_batch(config, plan.mesh.axis_size(Axis::dp));
  check_sequence_parallel(config, plan);
  check_autocast(config, plan);
  check_strategy_trains(config, *plan.strategy);
  check_model_fits_data(config, plan);
  if (plan.mesh.axis_size(Axis::pp) > 1) check_pipeline(config, plan);
  const ModelDescription& description = plan.model->description();
  if (!config.model.checkpoint.empty()) read_consolidated(config, description);
  if (!config.checkpoint.resume_from.empty()) read_index(config, description);
  check_comm_plugins(config, PluginLoader::from_environment());
  if (config.dist_env.on_cuda()) require_usable_devices(config, cuda_devices(), ranks_per_node);
}

void train_in_worlds(const Config& config, const std::optional<std::string>& output_dir,
                     const GemmPeakMeter& gemm_peak, Communicator& host_world,
                     Communicator& state_world, const RankDevice& device,
                     const StepObserver& observer) {
  const Plan plan = make_plan(config, host_world.size(), PluginLoader::from_environment());
  MeshCommunicators host_axes(host_world, plan.mesh);
  std::optional<MeshCommunicators> own_state_axes;
  if (&state_world != &host_world) {
    own_state_axes.emplace(state_world, plan.mesh);
    if (device.comm_stream != nullptr) {
      for (const Axis axis : strategy_axes(plan.mesh)) {
        own_state_axes->axis(axis).set_stream(device.comm_stream);
      }
      // The executor's transfers run in the stages' order on their stream
      // (pipeline::Executor).
      own_state_axes->axis(Axis::pp).set_stream(device.state.stream());
    }
  }
  MeshCommunicators& state_axes = own_state_axes ? *own_state_axes : host_axes;
  // The folder's name: run_training makes it.
  const RunOutput output{output_dir ? *output_dir : default_output_dir(host_world), gemm_peak,
                         observer};
  const TokenData data(config);
  const RankComms comms{host_world, host_axes, state_world, state_axes};
  if (plan.mesh.axis_size(Axis::pp) > 1) {
    train_pipeline(config, plan, data, comms, device, output);
  } else {
    train_data_parallel(config, plan, data, comms, device, output);
  }
}

int train_rank(const Config& config, const std::optional<std::string>& output_dir,
               const GemmPeakMeter& gemm_peak) {
  // Past a file-size limit (ulimit -f) a write then fails with EFBIG, which
  // names the file, instead of the signal killing the rank without a word.
  std::signal(SIGXFSZ, SIG_IGN);
  // A GPU run's world for the trainer's host memory is MPI's; its NCCL world
  // starts from it (train_on_gpu).
  CommBackend backend(PluginLoader::from_environment(),
                      config.dist_env.on_cuda() ? "mpi" : config.comm.backend);
  Communicator world = backend.world(config.comm.timeout_minutes * 60.0);
  try {
    train_in_world(config, output_dir, gemm_peak, world, {});
  } catch (const NonFiniteStep& stop) {
    if (world.rank() == 0) std::fprintf(stderr, "meshrun: error: %s\n", stop.what());
    return 1;
  } catch (const std::exception& error) {
    launch::abort_rank(world.rank(), error.what());
  }
  return 0;
}

void train_in_process(const Config& config, const std::optional<std::string>& output_dir,
                      const GemmPeakMeter& gemm_peak, Communicator& world,
                      const StepObserver& observer, Communicator* gpu_world) {
  check_training_input(config, make_plan(config, world.size(), PluginLoader::from_environment()));
  train_in_world(config, output_dir, gemm_peak, world, observer, gpu_world);
}

}  // namespace meshrun::train
