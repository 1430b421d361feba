#include "train/run.hpp"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "launch/launch.hpp"
#include "strategy/strategy.hpp"
#include "train/input_error.hpp"
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

llama::LlamaModel make_model(const Config& config) {
  try {
    return llama::LlamaModel(llama_config(config.model));
  } catch (const std::invalid_argument& error) {
    throw config_error(config, "model", error.what());
  }
}

// The strategy's keys of [distributed] as AutoModel names them (DDPConfig
// or FSDP2Config), for the strategy plugin.
std::string strategy_options(const DistributedConfig& d) {
  if (d.strategy != "fsdp2") {
    return nlohmann::json{{"bucket_cap_mb", d.bucket_cap_mb},
                          {"broadcast_buffers", d.broadcast_buffers},
                          {"find_unused_parameters", d.find_unused_parameters},
                          {"gradient_as_bucket_view", d.gradient_as_bucket_view},
                          {"static_graph", d.static_graph}}
        .dump();
  }
  const MixedPrecisionConfig& mp = d.mp_policy;
  nlohmann::json options{{"pp_size", d.pp_size},
                         {"dp_replicate_size", d.dp_replicate_size},
                         {"reshard_after_forward", nullptr},
                         {"defer_fsdp_grad_sync", d.defer_fsdp_grad_sync},
                         {"enable_fsdp2_prefetch", d.enable_fsdp2_prefetch},
                         {"fsdp2_forward_prefetch_depth", d.fsdp2_forward_prefetch_depth},
                         {"fsdp2_backward_prefetch_depth", d.fsdp2_backward_prefetch_depth},
                         {"mp_policy",
                          {{"param_dtype", mp.param_dtype},
                           {"reduce_dtype", mp.reduce_dtype},
                           {"output_dtype", mp.output_dtype},
                           {"cast_forward_inputs", mp.cast_forward_inputs}}}};
  if (d.reshard_after_forward) options["reshard_after_forward"] = *d.reshard_after_forward;
  return options.dump();
}

// The trainer runs data and pipeline parallelism: the reference model has
// no tensor, context or expert parallel execution yet (the plan shows those
// layouts; `meshrun plan` prints them).
void check_parallel_sizes(const Config& config) {
  const DistributedConfig& d = config.distributed;
  for (const auto& [key, size] : {std::pair{"distributed.tp_size", d.tp_size},
                                  {"distributed.cp_size", d.cp_size},
                                  {"distributed.ep_size", d.ep_size}}) {
    if (size != 1) {
      throw config_error(config, key,
                         fmt::format("{} > 1: meshrun train runs data and pipeline parallelism "
                                     "only so far (ddp; fsdp2 with dp_replicate_size, dp_shard "
                                     "and pp_size); set it to 1, or see the layout with "
                                     "`meshrun plan`",
                                     size));
    }
  }
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
  try {
    pipeline_schedule(config, plan, config.distributed.pp_size,
                      int64_t(plan.model.at("pipeline").size()), pipeline_microbatches(config, dp));
  } catch (const Error& error) {
    throw config_error(config, key, error.what());
  }
}

StrategyBuffers strategy_buffers(llama::LlamaModel& model) {
  StrategyBuffers buffers{
      model.param_buffer(), model.grad_buffer(), model.num_parameters(), {0}, {}};
  for (const auto& view : model.parameters()) {
    buffers.parameter_offsets.push_back(buffers.parameter_offsets.back() + view.numel);
    buffers.parameter_names.push_back(view.name);
  }
  return buffers;
}

// runs/<rank 0's start time>, the same on every rank.
std::string default_output_dir(Communicator& world) {
  int64_t now = std::time(nullptr);
  FlatTensor tensor(&now, dtype_int64(), 1);
  world.broadcast(tensor.get(), 0).wait();
  return fmt::format("runs/{:%Y%m%d-%H%M%S}", fmt::localtime(std::time_t(now)));
}

void start_weights(const Config& config, llama::LlamaModel& model) {
  if (config.model.checkpoint.empty()) {
    model.init_weights(uint64_t(config.train.seed));
  } else {
    read_consolidated(config, model, true);
  }
  if (config.model.torch_dtype == "bfloat16") {
    llama::round_to_bfloat16(model.param_buffer(), model.num_parameters());
  }
}

void announce(const Config& config, Communicator& world, const llama::LlamaModel& model,
              const std::string& output_dir) {
  if (world.rank() != 0) return;
  std::printf("meshrun train: %lld ranks, strategy %s, pp %lld, %lld parameters, output %s\n",
              static_cast<long long>(world.size()), config.distributed.strategy.c_str(),
              static_cast<long long>(config.distributed.pp_size),
              static_cast<long long>(model.num_parameters()), output_dir.c_str());
  std::fflush(stdout);
}

void train_in_world(const Config& config, const std::optional<std::string>& output,
                    Communicator& world) {
  const PluginLoader loader = PluginLoader::from_environment();
  const Plan plan = make_plan(config, world.size(), loader);
  MeshCommunicators axes(world, plan.mesh);
  Communicator& data_parallel = axes.axis(Axis::dp);
  Communicator& shard_group = axes.axis(Axis::dp_shard_cp);
  Communicator& replicate_group = axes.axis(Axis::dp_replicate);
  const std::string output_dir = output ? *output : default_output_dir(world);
  if (world.rank() == 0) std::filesystem::create_directories(output_dir);
  const TokenData data(config);
  llama::LlamaModel model = make_model(config);
  start_weights(config, model);
  if (plan.mesh.axis_size(Axis::pp) > 1) {
    PipelineTrainer trainer({config, data, plan, model, world, axes.axis(Axis::pp), data_parallel,
                             shard_group, replicate_group, strategy_options(config.distributed),
                             output_dir});
    if (!config.checkpoint.resume_from.empty()) {
      trainer.resume(read_index(config, model.num_parameters()));
    }
    announce(config, world, model, output_dir);
    trainer.run();
    return;
  }
  // A sidecar of ABI 1.0 plans no units: only a replicated strategy can train.
  StrategyUnits units =
      plan.model.is_null() ? StrategyUnits{} : model_units(plan.model.at("units"), model);
  units.shard_group = &shard_group;
  units.replicate_group = &replicate_group;
  Strategy strategy(plan.strategy, data_parallel, strategy_buffers(model),
                    strategy_options(config.distributed), &units);
  // The strategy copied its shard: the full weights are no longer needed.
  if (strategy.sharded()) model.release_storage();
  Trainer trainer({config, data, model, strategy, world, data_parallel, shard_group,
                   replicate_group, units, output_dir});
  if (!config.checkpoint.resume_from.empty()) {
    trainer.resume(read_index(config, model.num_parameters()));
  }
  strategy.broadcast_parameters();
  announce(config, world, model, output_dir);
  trainer.run();
}

}  // namespace

void check_training_input(const Config& config, const Plan& plan) {
  const TokenData data(config);
  check_batch(config, plan.mesh.axis_size(Axis::dp));
  check_parallel_sizes(config);
  check_strategy_trains(config, *plan.strategy);
  if (plan.mesh.axis_size(Axis::pp) > 1) check_pipeline(config, plan);
  llama::LlamaModel model = make_model(config);
  if (!config.model.checkpoint.empty()) read_consolidated(config, model, false);
  if (!config.checkpoint.resume_from.empty()) read_index(config, model.num_parameters());
}

void train_rank(const Config& config, const std::optional<std::string>& output_dir) {
  CommBackend backend(PluginLoader::from_environment(), config.comm.backend);
  Communicator world = backend.world(config.comm.timeout_minutes * 60.0);
  try {
    train_in_world(config, output_dir, world);
  } catch (const std::exception& error) {
    launch::abort_rank(world.rank(), error.what());
  }
}

}  // namespace meshrun::train
