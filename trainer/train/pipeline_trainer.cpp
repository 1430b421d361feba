#include "train/pipeline_trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "errors.hpp"
#include "train/experts.hpp"

namespace meshrun::train {

// Parameters of a held stage with a strategy of their own: the stage's
// (its dense ones in a mixture of experts), or its experts over ep_shard.
struct PipelineTrainer::HeldPart {
  HeldPart(const ModelDescription& local, const StageContents& contents, StateDevice& state)
      : parameters(local, contents.parameters, state) {}

  FlatParameters parameters;
  StageUnits units;
  std::unique_ptr<Strategy> strategy;
  LocalParameters local;
  std::unique_ptr<AdamW> optimizer;
  bool experts = false;  // its norm sums over ep_shard and ep, its gradients / ep
};

// A stage this rank holds: its parts, each in the stage's own flat layout
// (the description's order, restricted to the part), and the compute.
struct PipelineTrainer::Held {
  Held(int64_t index, std::vector<std::string> modules)
      : index(index), modules(std::move(modules)) {}

  int64_t index = 0;  // the global stage
  std::vector<std::string> modules;
  std::vector<std::unique_ptr<HeldPart>> parts;
  std::unique_ptr<PipelineStage> work;
};

schedule::Schedule pipeline_schedule(const Config& config, const Plan& plan, int64_t pp,
                                     int64_t stages, int64_t microbatches) {
  const PipelineConfig& p = config.distributed.pipeline;
  const int64_t per_rank = stages / pp;
  schedule::Schedule lowered =
      p.pp_schedule_csv.empty()
          ? schedule::lower(schedule::generate(*plan.schedule, pp, per_rank, microbatches))
          : schedule::read_csv(p.pp_schedule_csv, pp, per_rank, microbatches);
  schedule::Schedule sharded = schedule::add_sharding_actions(lowered);
  schedule::validate(sharded);
  return sharded;
}

PipelineTrainer::PipelineTrainer(PipelineContext context)
    : ctx_(std::move(context)),
      state_(ctx_.device.state),
      computing_(computing_axes(ctx_.comms.state, ctx_.plan.mesh)) {
  Communicator& pipeline = state_axis(Axis::pp);
  microbatches_ = pipeline_microbatches(ctx_.config, host_axis(Axis::dp).size());
  build_stages();
  const auto& split = ctx_.plan.model_plan.at("pipeline");
  schedule::Schedule schedule = pipeline_schedule(ctx_.config, ctx_.plan, pipeline.size(),
                                                  int64_t(split.size()), microbatches_);
  for (const auto& stage : split) {
    const auto index = stage.at("stage").get<size_t>();
    if (schedule.stage_rank.at(index) != stage.at("rank").get<int64_t>()) {
      throw invalid_argument(fmt::format(
          "schedule {} places stage {} on rank {}, the sidecar's split on rank {}", schedule.name,
          index, schedule.stage_rank.at(index), stage.at("rank").get<int64_t>()));
    }
  }
  std::map<int64_t, pipeline::HeldStage> stages;
  for (auto& held : held_)
    stages.emplace(held->index, pipeline::HeldStage{*held->work, held->work.get()});
  executor_.emplace(std::move(schedule), pipeline.rank(), pipeline, std::move(stages),
                    ctx_.config.distributed.pipeline.pp_recv_buffer_pool, state_);
}

bool PipelineTrainer::expert_parallel() const {
  return ctx_.plan.mesh.has_moe() && ctx_.plan.mesh.axis_size(Axis::ep) > 1;
}

PipelineTrainer::~PipelineTrainer() = default;

PipelineTrainer::HeldPart& PipelineTrainer::add_part(Held& held, const StageContents& contents,
                                                     const StrategyGroups& groups,
                                                     const StrategyGroups& host,
                                                     const std::string& options) {
  const Model& model = *ctx_.plan.model;
  const ModelDescription& local = ctx_.plan.tensor_parallel->local();
  auto part = std::make_unique<HeldPart>(local, contents, state_);
  start_weights(ctx_.config, model, tensor_parallel(), part->parameters);
  part->units = stage_units(local, contents);
  part->units.strategy.shard_group = &groups.shard;
  part->units.strategy.replicate_group = &groups.replicate;
  StrategyBuffers buffers = part->parameters.strategy_buffers(local);
  buffers.comm_stream = ctx_.device.comm_stream;
  part->strategy = std::make_unique<Strategy>(ctx_.plan.strategy, groups.data_parallel,
                                              std::move(buffers), options, &part->units.strategy);
  if (!part->strategy->sharded()) {
    throw invalid_argument(
        fmt::format("strategy {} does not shard; pipeline training needs "
                    "fsdp2 on the data-parallel axis",
                    part->strategy->library().name()));
  }
  part->parameters.release();
  part->local = sharded_parameters(*part->strategy, host.shard, host.replicate);
  part->optimizer = std::make_unique<AdamW>(
      ctx_.config.train, decay_mask(part->local, model.description(), part->parameters.indices),
      state_);
  held.parts.push_back(std::move(part));
  return *held.parts.back();
}

// The stages of this rank: their starting weights, handed to a strategy
// instance each (two with expert parallelism: the experts' over ep_shard),
// which shards them.
void PipelineTrainer::build_stages() {
  const Model& model = *ctx_.plan.model;
  const ModelDescription& local = ctx_.plan.tensor_parallel->local();
  const std::string plan_json = ctx_.plan.model_plan.dump();
  const bool scale_in_schedule = ctx_.config.distributed.pipeline.scale_grads_in_schedule;
  const RankComms& comms = ctx_.comms;
  const StrategyGroups dense_state = dense_groups(comms.state);
  const StrategyGroups dense_host = dense_groups(comms.host);
  if (expert_parallel()) expert_groups_.emplace(comms, ctx_.device.comm_stream);
  const ExpertPlacement placement =
      expert_parallel() ? ExpertPlacement{host_axis(Axis::ep).rank(), host_axis(Axis::ep).size()}
                        : ExpertPlacement{};
  for (const auto& split : ctx_.plan.model_plan.at("pipeline")) {
    if (split.at("rank").get<int64_t>() != host_axis(Axis::pp).rank()) continue;
    auto held = std::make_unique<Held>(split.at("stage").get<int64_t>(),
                                       split.at("modules").get<std::vector<std::string>>());
    const StageContents contents = stage_contents(model, held->modules, placement);
    if (!expert_parallel()) {
      add_part(*held, contents, dense_state, dense_host, ctx_.strategy_options);
    } else {
      const auto [dense, experts] = split_experts(model.description(), contents);
      add_part(*held, dense, dense_state, dense_host, ctx_.strategy_options);
      if (!experts.parameters.empty()) {
        add_part(*held, experts, expert_groups_->state(), expert_groups_->host(),
                 expert_options(ctx_.config, ctx_.strategy_options))
            .experts = true;
      }
    }
    std::vector<StrategyPart> parts;
    for (const auto& part : held->parts) {
      parts.push_back({*part->strategy, part->units, part->parameters.indices});
    }
    held->work = std::make_unique<PipelineStage>(
        model, local, held->modules, parts, computing_, plan_json, ctx_.strategy_options,
        scale_in_schedule ? float(1.0 / double(microbatches_)) : 1.0f,
        StageDevice{state_.where(), state_.stream()}, [this] { sample_activations(); });
    held_.push_back(std::move(held));
  }
}

double PipelineTrainer::all_reduce(double value, ReduceOp op, Communicator& over) {
  auto single = float(value);
  FlatTensor tensor(&single, dtype_float32(), 1);
  over.all_reduce(tensor.get(), op).wait();
  return single;
}

void PipelineTrainer::train_step(int64_t step, StepMetrics& metrics) {
  const TrainConfig& train = ctx_.config.train;
  Communicator& data_parallel = host_axis(Axis::dp);
  const int64_t share = train.global_batch_size / data_parallel.size();
  const int64_t micro = ctx_.config.distributed.pipeline.pp_microbatch_size;
  const int64_t seq_len = ctx_.data.seq_len();
  ctx_.data.training_batch(uint64_t(train.seed), step, data_parallel.rank() * share, share, tokens_,
                           targets_);
  const int32_t* tokens = copy_to_state(state_, tokens_, stage_tokens_);
  const int32_t* targets = copy_to_state(state_, targets_, stage_targets_);
  for (auto& held : held_) {
    held->work->compute().set_shape(micro, seq_len);
    held->work->set_batch(tokens, targets, micro * seq_len);
    for (auto& part : held->parts) state_.zero(part->local.grads, part->local.numel);
    held->work->compute().take_tensor_parallel_bytes();  // not this step's: validation's
    held->work->compute().take_context_parallel_traffic();
    held->work->compute().take_expert_parallel_traffic();
  }
  activations_.begin_step();
  const pipeline::StepTimes times = executor_->run_step();
  const auto sync_start = std::chrono::steady_clock::now();
  for (auto& held : held_) {
    for (auto& part : held->parts) part->strategy->finish_gradients();
  }
  metrics.grad_sync_wait_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
  metrics.comm_wait_s = metrics.grad_sync_wait_s + times.wait_s + times.sharding_s;
  for (auto& held : held_) {
    metrics.tp_bytes += held->work->compute().take_tensor_parallel_bytes();
    const CommTraffic context = held->work->compute().take_context_parallel_traffic();
    metrics.cp_bytes += context.bytes;
    metrics.cp_wait_s += context.wait_seconds;
  }
  // The objective is the mean over the microbatches: without
  // scale_grads_in_schedule the last stage seeded each with 1, so the
  // accumulated gradients are scaled here. An expert's gradient sums its
  // ep group's ranks' tokens: the strategy averaged it over ep_shard, / ep
  // makes it the global batch's.
  const bool in_schedule = ctx_.config.distributed.pipeline.scale_grads_in_schedule;
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      double scale = in_schedule ? 1.0 : 1.0 / double(microbatches_);
      if (part->experts) scale /= double(host_axis(Axis::ep).size());
      if (scale != 1.0) state_.scale(part->local.grads, part->local.numel, float(scale));
    }
  }
  double loss = 0;
  std::optional<RouterStatistics> routers;
  CommTraffic experts;
  for (auto& held : held_) {
    loss += held->work->take_loss_sum() / double(microbatches_);
    const auto stage = held->work->compute().take_router_statistics();
    const CommTraffic traffic = held->work->compute().take_expert_parallel_traffic();
    experts.bytes += traffic.bytes;
    experts.wait_seconds += traffic.wait_seconds;
    if (!stage) continue;
    if (!routers) routers.emplace();
    routers->aux_loss += stage->aux_loss;
    routers->expert_tokens.resize(
        std::max(routers->expert_tokens.size(), stage->expert_tokens.size()));
    for (size_t e = 0; e < stage->expert_tokens.size(); ++e) {
      routers->expert_tokens[e] += stage->expert_tokens[e];
    }
  }
  if (!counts_model_result()) loss = 0;
  metrics.loss =
      all_reduce(loss, ReduceOp::sum, ctx_.comms.host_world) / double(data_parallel.size());
  // Each pipeline stage adds its layers' share of the routers' statistics.
  if (!counts_model_result()) routers.reset();
  metrics.moe = gather_expert_metrics(routers, ctx_.plan.model->description(),
                                      double(microbatches_ * data_parallel.size()), experts,
                                      ctx_.comms.host_world);
}

double PipelineTrainer::gradient_norm() {
  // The shards of a stage partition it over the shard group, the stages
  // partition the model over the pipeline, and tp ranks hold pieces of the
  // sharded parameters; replicas hold equal shards.
  // The experts' shards partition them over ep_shard, and the ep ranks hold
  // different experts.
  double squared = 0, experts = 0;
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      (part->experts ? experts : squared) += tensor_parallel_squared_norm(
          state_, part->local, part->parameters.indices, tensor_parallel());
    }
  }
  squared = all_reduce(squared, ReduceOp::sum, host_axis(Axis::dp_shard_cp));
  if (expert_parallel()) {
    experts = all_reduce(experts, ReduceOp::sum, host_axis(Axis::ep_shard));
    squared += all_reduce(experts, ReduceOp::sum, host_axis(Axis::ep));
  }
  squared = all_reduce(squared, ReduceOp::sum, host_axis(Axis::pp));
  if (host_axis(Axis::tp).size() > 1)
    squared = all_reduce(squared, ReduceOp::sum, host_axis(Axis::tp));
  return std::sqrt(squared);
}

void PipelineTrainer::optimizer_step(const StepMetrics& metrics) {
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      LocalParameters& local = part->local;
      clip_gradients(state_, local.grads, local.numel, metrics.grad_norm,
                     ctx_.config.train.max_grad_norm);
      part->optimizer->step(local.params, local.grads, metrics.lr);
      state_.round_to(local.params, local.numel, ctx_.config.model.torch_dtype);
    }
  }
}

std::optional<int64_t> PipelineTrainer::first_nonfinite_gradient() {
  std::optional<int64_t> first;
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      const auto found =
          meshrun::first_nonfinite_gradient(state_, part->local, part->parameters.indices);
      if (found && (!first || *found < *first)) first = found;
    }
  }
  return first;
}

// One evaluation batch of `count` sequences (in tokens_/targets_) through
// the stages in order, activations passed on as they are made; the summed
// token losses on the rank of the last stage, else 0.
double PipelineTrainer::forward_for_evaluation(int64_t count) {
  const auto& split = ctx_.plan.model_plan.at("pipeline");
  Communicator& pipeline = state_axis(Axis::pp);
  const int64_t seq_len = ctx_.data.seq_len(), me = pipeline.rank();
  const int32_t* tokens = copy_to_state(state_, tokens_, stage_tokens_);
  const int32_t* targets = copy_to_state(state_, targets_, stage_targets_);
  const auto sized = [&](StateArray<float>& buffer, int64_t numel) {
    if (buffer.size() != numel) buffer = StateArray<float>(numel, state_);
    return buffer.data();
  };
  const auto transfer = [&](float* data, int64_t numel) {
    return FlatTensor(data, dtype_float32(), numel, state_.where());
  };
  StateArray<float> input, output;
  double sum = 0;
  auto held = held_.begin();
  for (size_t s = 0; s < split.size(); ++s) {
    if (split[s].at("rank").get<int64_t>() != me) continue;
    ModelStage& stage = (*held++)->work->compute();
    stage.set_shape(count, seq_len);
    const bool previous_here = s > 0 && split[s - 1].at("rank").get<int64_t>() == me;
    if (previous_here) std::swap(input, output);
    float* in = sized(input, stage.input_numel());
    if (s > 0 && !previous_here) {
      FlatTensor tensor = transfer(in, input.size());
      pipeline.recv(tensor.get(), split[s - 1].at("rank").get<int64_t>(), int64_t(s)).wait();
    }
    float* out = sized(output, stage.output_numel());
    const double loss = stage.forward(0, tokens, targets, in, out);
    stage.discard(0);
    if (s + 1 == split.size()) sum = loss * double(count * seq_len);
    if (s + 1 < split.size() && split[s + 1].at("rank").get<int64_t>() != me) {
      FlatTensor tensor = transfer(out, output.size());
      pipeline.send(tensor.get(), split[s + 1].at("rank").get<int64_t>(), int64_t(s + 1)).wait();
    }
  }
  return sum;
}

// Every tp and cp rank of the last stage has the loss of the same
// micro-batches (the model sums it over cp): tp and cp rank 0's counts, as
// do their copies of the stage's weights.
bool PipelineTrainer::counts_model_result() const {
  return host_axis(Axis::tp).rank() == 0 && host_axis(Axis::cp).rank() == 0;
}

// The windows shared out over the data-parallel ranks, as Trainer does.
// With expert parallelism a forward is collective over the ep ranks (its
// all-to-alls), so a rank with fewer windows runs forwards of window 0
// whose loss it drops, until it has run as many as the rank with the most.
std::optional<double> PipelineTrainer::validate() {
  const int64_t windows = ctx_.data.val_windows();
  if (windows == 0) return std::nullopt;
  const int64_t ranks = host_axis(Axis::dp).size(), rank = host_axis(Axis::dp).rank();
  const int64_t begin = rank * windows / ranks, end = (rank + 1) * windows / ranks;
  const int64_t micro = ctx_.config.distributed.pipeline.pp_microbatch_size;
  const int64_t most_windows = (windows + ranks - 1) / ranks;
  const int64_t forwards = expert_parallel() ? (most_windows + micro - 1) / micro : 0;
  for (auto& held : held_) held->work->gather_for_evaluation();
  double sum = 0;
  int64_t done = 0;
  for (int64_t first = begin; first < end; first += micro, ++done) {
    const int64_t count = std::min(micro, end - first);
    ctx_.data.validation_batch(first, count, tokens_, targets_);
    sum += forward_for_evaluation(count);
  }
  for (; done < forwards; ++done) {
    ctx_.data.validation_batch(0, 1, tokens_, targets_);
    forward_for_evaluation(1);
  }
  if (!counts_model_result()) sum = 0;
  return all_reduce(sum, ReduceOp::sum, ctx_.comms.host_world) /
         double(windows * ctx_.data.seq_len());
}

MemoryUse PipelineTrainer::memory_use() {
  MemoryUse use;
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      const int64_t bytes = part->local.numel * int64_t(sizeof(float));
      const StrategyMemory strategy = part->strategy->memory();
      use.params += bytes;
      use.grads += bytes;
      use.optimizer += part->optimizer->state_bytes();
      use.buffers += strategy.buffers;
      use.buffers_peak += strategy.buffers_peak;
      use.buffers_reserved += strategy.buffers_reserved;
      if (!part->experts) continue;
      if (!use.experts) use.experts = MemoryUse::Experts{};
      use.experts->params += bytes;
      use.experts->buffers_peak += strategy.buffers_peak;
    }
  }
  use.buffers_peak += executor_->peak_buffer_bytes();
  use.buffers_reserved += executor_->pooled_buffer_bytes();
  activations_.report(use);
  use.peak_rss = peak_rss_bytes();
  report_device_memory(ctx_.device.gpu, use);
  return use;
}

void PipelineTrainer::sample_activations() {
  int64_t bytes = 0;
  for (auto& held : held_) bytes += held->work->compute().activation_bytes();
  activations_.sample(bytes);
  if (ctx_.device.gpu != nullptr) ctx_.device.gpu->sample_memory();
}

// A shard's saved ranges are its replica 0's only (sharded_parameters).
std::vector<HeldRange> PipelineTrainer::rank_ranges(bool saved) const {
  std::vector<HeldRange> ranges;
  int64_t base = 0;
  for (const auto& held : held_) {
    for (const auto& part : held->parts) {
      const auto stage = model_ranges(saved ? part->local.saved : part->local.held,
                                      part->parameters, tensor_parallel(), saved, base);
      ranges.insert(ranges.end(), stage.begin(), stage.end());
      base += part->local.numel;
    }
  }
  return ranges;
}

std::vector<ShardState> PipelineTrainer::shard_states() {
  std::vector<ShardState> shards;
  for (auto& held : held_) {
    for (auto& part : held->parts) shards.push_back({&part->local, part->optimizer.get()});
  }
  return shards;
}

void PipelineTrainer::save_checkpoint(int64_t step) {
  auto state = concatenated_state(shard_states());
  const auto dir =
      std::filesystem::path(ctx_.output_dir) / "checkpoints" / fmt::format("step_{}", step);
  save_sharded(
      dir.string(), checkpoint_layout(ctx_.config.model, ctx_.plan.model->description()),
      ctx_.config.train.seed, step, rank_ranges(true),
      {{"params", state[0].data()}, {"exp_avg", state[1].data()}, {"exp_avg_sq", state[2].data()}},
      ctx_.comms.host_world);
}

void PipelineTrainer::resume(const CheckpointIndex& index) {
  auto state = concatenated_state(shard_states());
  load_sharded(
      index, rank_ranges(false),
      {{"params", state[0].data()}, {"exp_avg", state[1].data()}, {"exp_avg_sq", state[2].data()}});
  scatter_state(state, shard_states());
  for (auto& held : held_) {
    for (auto& part : held->parts) part->optimizer->restore(index.step);
  }
  next_step_ = index.step;
}

// Every stage gathered over dp and tp, copied into the full layout by rank
// 0 of dp, tp and cp of its pipeline rank, and summed over the world: each
// element has one writer, so the sum is exact.
void PipelineTrainer::export_weights() {
  if (!ctx_.config.checkpoint.export_consolidated) return;
  const ModelDescription& description = ctx_.plan.model->description();
  std::vector<float> full(size_t(description.numel), 0.0f), stage_full(full.size());
  for (auto& held : held_) {
    for (auto& part : held->parts) {
      const int64_t numel = part->parameters.numel();
      StateArray<float> gathered(numel, state_);
      part->strategy->gather_parameters(gathered.data(), numel);
      HostView stage(state_, gathered.data(), numel);
      gather_tensor_parallel(part->parameters, stage.data(), tensor_parallel(), stage_full.data());
      const bool writes = part->experts ? host_axis(Axis::ep_shard).rank() == 0
                                        : host_axis(Axis::dp).rank() == 0 && counts_model_result();
      if (!writes) continue;
      for (const int64_t p : part->parameters.indices) {
        const ModelParameter& parameter = description.parameters[size_t(p)];
        std::copy_n(stage_full.begin() + parameter.offset, parameter.numel,
                    full.begin() + parameter.offset);
      }
    }
  }
  FlatTensor tensor(full.data(), dtype_float32(), int64_t(full.size()));
  ctx_.comms.host_world.all_reduce(tensor.get(), ReduceOp::sum).wait();
  if (ctx_.comms.host_world.rank() == 0) {
    export_consolidated(ctx_.output_dir, ctx_.config.model, description, full.data());
  }
}

void PipelineTrainer::run(const StepObserver& observer) {
  for (auto& held : held_) {
    for (auto& part : held->parts) part->strategy->broadcast_parameters();
  }
  run_training(ctx_.config, ctx_.plan.model->description(),
               ctx_.config.train.global_batch_size * ctx_.data.seq_len(), ctx_.comms.host_world,
               ctx_.output_dir, ctx_.gemm_peak, next_step_, *this, observer);
}

}  // namespace meshrun::train
