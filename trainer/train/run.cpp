#include "train/run.hpp"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "launch/launch.hpp"
#include "mesh/device.hpp"
#include "state/input_error.hpp"
#include "strategy/strategy.hpp"
#include "train/experts.hpp"
#include "train/hooks.hpp"
#include "train/pipeline_trainer.hpp"
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

StageCommunicators computing_axes(MeshCommunicators& axes, const MeshContext& mesh) {
  return {&axes.axis(Axis::tp), &axes.axis(Axis::cp),
          mesh.has_moe() ? &axes.axis(Axis::ep) : nullptr};
}

// Where a rank's run writes, what its mfu divides by, and who hears of
// each step.
struct RunOutput {
  std::string dir;
  GemmPeakMeter gemm_peak;
  StepObserver observer;
};

void run_trainer(const Config& config, const Plan& plan, const TokenData& data, Communicator& world,
                 MeshCommunicators& axes, const RunOutput& output,
                 const std::vector<std::string>& modules, const std::string& options,
                 StateDevice& state, std::vector<TrainPart> parts) {
  Trainer trainer({config, data, *plan.model, modules, std::move(parts), state, world,
                   axes.axis(Axis::dp), computing_axes(axes, plan.mesh), *plan.tensor_parallel,
                   plan.model_plan.dump(), options, output.dir, output.gemm_peak});
  if (!config.checkpoint.resume_from.empty()) {
    trainer.resume(read_index(config, plan.model->description()));
  }
  trainer.broadcast_parameters();
  announce(config, world, *plan.model, output.dir);
  trainer.run(output.observer);
}

// One strategy's parameters on this rank: their starting weights, units
// and strategy, which shards them.
struct RankPart {
  RankPart(const Config& config, const Plan& plan, const TensorParallelRank& tp,
           const StageContents& contents, Communicator& data_parallel, Communicator& shard_group,
           Communicator& replicate_group, const std::string& options, StateDevice& state)
      : parameters(plan.tensor_parallel->local(), contents.parameters, state,
                   !config.distributed.init_fsdp_with_meta_device),
        units(stage_units(plan.tensor_parallel->local(), contents)) {
    // Megatron-FSDP's meta-device init: the weights go straight into each
    // rank's shard, and no rank holds the whole model.
    const bool by_shard = config.distributed.init_fsdp_with_meta_device;
    if (!by_shard) start_weights(config, *plan.model, tp, parameters);
    units.strategy.shard_group = &shard_group;
    units.strategy.replicate_group = &replicate_group;
    strategy = std::make_unique<Strategy>(
        plan.strategy, data_parallel, parameters.strategy_buffers(plan.tensor_parallel->local()),
        options, &units.strategy);
    // The strategy copied its shard: the full weights are no longer needed.
    if (strategy->sharded()) parameters.release();
    if (by_shard) start_shard_weights(config, *plan.model, tp, parameters, *strategy);
  }

  FlatParameters parameters;
  StageUnits units;
  std::unique_ptr<Strategy> strategy;
};

// A mixture of experts trains its experts with a strategy instance of
// their own: over ep_shard (no replicas) with expert parallelism, else over
// the dense parameters' groups.
void train_data_parallel(const Config& config, const Plan& plan, const TokenData& data,
                         Communicator& world, MeshCommunicators& axes, const RunOutput& output) {
  const Model& model = *plan.model;
  const std::vector<std::string> modules = module_names(model.description());
  const TensorParallelRank tp{*plan.tensor_parallel, axes.axis(Axis::tp)};
  const std::string options = strategy_options_json(config.distributed);
  // The rank's state (parameters, gradients, moments) is host memory.
  StateDevice& state = host_state_device();
  Communicator& dp = axes.axis(Axis::dp);
  Communicator& dp_shard_cp = axes.axis(Axis::dp_shard_cp);
  Communicator& dp_replicate = axes.axis(Axis::dp_replicate);
  const bool moe = plan.mesh.has_moe() && plan.mesh.axis_size(Axis::ep) > 1;
  if (!model.description().experts || !strategy_shards(*plan.strategy)) {
    RankPart part(config, plan, tp, stage_contents(model, modules), dp, dp_shard_cp, dp_replicate,
                  options, state);
    run_trainer(
        config, plan, data, world, axes, output, modules, options, state,
        {TrainPart{*part.strategy, part.parameters, part.units, dp_shard_cp, dp_replicate}});
    return;
  }
  const ExpertPlacement placement =
      moe ? ExpertPlacement{axes.axis(Axis::ep).rank(), axes.axis(Axis::ep).size()}
          : ExpertPlacement{};
  const auto [dense_contents, expert_contents] =
      split_experts(model.description(), stage_contents(model, modules, placement));
  RankPart dense(config, plan, tp, dense_contents, dp, dp_shard_cp, dp_replicate, options, state);
  TrainPart dense_part{*dense.strategy, dense.parameters, dense.units, dp_shard_cp, dp_replicate};
  dense_part.exports = dp.rank() == 0;
  if (!moe) {
    RankPart experts(config, plan, tp, expert_contents, dp, dp_shard_cp, dp_replicate, options,
                     state);
    TrainPart expert_part{*experts.strategy, experts.parameters, experts.units, dp_shard_cp,
                          dp_replicate};
    expert_part.exports = dp.rank() == 0;
    run_trainer(config, plan, data, world, axes, output, modules, options, state,
                {dense_part, expert_part});
    return;
  }
  Communicator& ep = axes.axis(Axis::ep);
  Communicator& ep_shard = axes.axis(Axis::ep_shard);
  Communicator alone = world.split(world.rank(), 0, "self");
  RankPart experts(config, plan, tp, expert_contents, ep_shard, ep_shard, alone,
                   expert_options(config, options), state);
  TrainPart expert_part{*experts.strategy, experts.parameters, experts.units, ep_shard, alone};
  expert_part.norm_across = &ep;
  expert_part.gradient_scale = float(1.0 / double(ep.size()));
  expert_part.exports = ep_shard.rank() == 0;
  run_trainer(config, plan, data, world, axes, output, modules, options, state,
              {dense_part, expert_part});
}

void train_in_world(const Config& config, const std::optional<std::string>& output_dir,
                    const GemmPeakMeter& gemm_peak, Communicator& world,
                    const StepObserver& observer) {
  const PluginLoader loader = PluginLoader::from_environment();
  const Plan plan = make_plan(config, world.size(), loader);
  MeshCommunicators axes(world, plan.mesh);
  const RunOutput output{output_dir ? *output_dir : default_output_dir(world), gemm_peak, observer};
  if (world.rank() == 0) std::filesystem::create_directories(output.dir);
  const TokenData data(config);
  if (plan.mesh.axis_size(Axis::pp) == 1) {
    train_data_parallel(config, plan, data, world, axes, output);
    return;
  }
  const bool moe = plan.mesh.has_moe() && plan.mesh.axis_size(Axis::ep) > 1;
  PipelineTrainer trainer({config, data, plan, world, axes.axis(Axis::pp), axes.axis(Axis::dp),
                           axes.axis(Axis::dp_shard_cp), axes.axis(Axis::dp_replicate),
                           moe ? &axes.axis(Axis::ep_shard) : nullptr,
                           computing_axes(axes, plan.mesh),
                           strategy_options_json(config.distributed), output.dir, gemm_peak});
  if (!config.checkpoint.resume_from.empty()) {
    trainer.resume(read_index(config, plan.model->description()));
  }
  announce(config, world, *plan.model, output.dir);
  trainer.run(observer);
}

}  // namespace

void check_training_input(const Config& config, const Plan& plan) {
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
  require_host_training(config);
  if (config.dist_env.on_cuda()) require_usable_devices(config, cuda_devices());
}

void require_host_training(const Config& config) {
  if (!config.dist_env.on_cuda()) return;
  throw config_error(config, "dist_env.backend",
                     "\"nccl\" trains on CUDA GPUs, and the trainer keeps the parameters, "
                     "gradients, optimizer state and the tensors it hands the model in host "
                     "memory: training on GPUs is not implemented yet; set it to \"gloo\" or "
                     "\"mpi\" to train on the CPU");
}

int train_rank(const Config& config, const std::optional<std::string>& output_dir,
               const GemmPeakMeter& gemm_peak) {
  // Past a file-size limit (ulimit -f) a write then fails with EFBIG, which
  // names the file, instead of the signal killing the rank without a word.
  std::signal(SIGXFSZ, SIG_IGN);
  CommBackend backend(PluginLoader::from_environment(), config.comm.backend);
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
                      const StepObserver& observer) {
  check_training_input(config, make_plan(config, world.size(), PluginLoader::from_environment()));
  train_in_world(config, output_dir, gemm_peak, world, observer);
}

}  // namespace meshrun::train
