#include "train/pipeline_trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "errors.hpp"

namespace meshrun::train {

// A stage this rank holds: its parameters in the stage's own flat layout
// (the description's order, restricted to the stage), their strategy, the
// compute, and AdamW on the local shard.
struct PipelineTrainer::Held {
  Held(const Model& model, const ModelDescription& local, int64_t index,
       std::vector<std::string> modules)
      : index(index),
        modules(std::move(modules)),
        parameters(local, stage_contents(model, this->modules).parameters) {}

  int64_t index = 0;  // the global stage
  std::vector<std::string> modules;
  FlatParameters parameters;
  StageUnits units;
  std::unique_ptr<Strategy> strategy;
  std::unique_ptr<PipelineStage> work;
  LocalParameters local;
  std::unique_ptr<AdamW> optimizer;
};

int64_t pipeline_microbatches(const Config& config, int64_t dp) {
  return config.train.global_batch_size / dp / config.distributed.pipeline.pp_microbatch_size;
}

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

PipelineTrainer::PipelineTrainer(PipelineContext context) : ctx_(std::move(context)) {
  microbatches_ = pipeline_microbatches(ctx_.config, ctx_.data_parallel.size());
  build_stages();
  const auto& split = ctx_.plan.model_plan.at("pipeline");
  schedule::Schedule schedule = pipeline_schedule(ctx_.config, ctx_.plan, ctx_.pipeline.size(),
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
  executor_.emplace(std::move(schedule), ctx_.pipeline.rank(), ctx_.pipeline, std::move(stages),
                    ctx_.config.distributed.pipeline.pp_recv_buffer_pool);
}

PipelineTrainer::~PipelineTrainer() = default;

// The stages of this rank: their starting weights, handed to a strategy
// instance each, which shards them.
void PipelineTrainer::build_stages() {
  const Model& model = *ctx_.plan.model;
  const ModelDescription& local = ctx_.plan.tensor_parallel->local();
  const std::string plan_json = ctx_.plan.model_plan.dump();
  const bool scale_in_schedule = ctx_.config.distributed.pipeline.scale_grads_in_schedule;
  for (const auto& split : ctx_.plan.model_plan.at("pipeline")) {
    if (split.at("rank").get<int64_t>() != ctx_.pipeline.rank()) continue;
    auto held = std::make_unique<Held>(model, local, split.at("stage").get<int64_t>(),
                                       split.at("modules").get<std::vector<std::string>>());
    start_weights(ctx_.config, model, tensor_parallel(), held->parameters);
    held->units = stage_units(local, stage_contents(model, held->modules));
    held->units.strategy.shard_group = &ctx_.shard_group;
    held->units.strategy.replicate_group = &ctx_.replicate_group;
    held->strategy = std::make_unique<Strategy>(ctx_.plan.strategy, ctx_.data_parallel,
                                                held->parameters.strategy_buffers(local),
                                                ctx_.strategy_options, &held->units.strategy);
    if (!held->strategy->sharded()) {
      throw invalid_argument(
          fmt::format("strategy {} does not shard; pipeline training needs "
                      "fsdp2 on the data-parallel axis",
                      held->strategy->library().name()));
    }
    held->parameters.release();
    held->local = sharded_parameters(*held->strategy, ctx_.shard_group, ctx_.replicate_group);
    held->optimizer = std::make_unique<AdamW>(
        ctx_.config.train, decay_mask(held->local, model.description(), held->parameters.indices));
    held->work = std::make_unique<PipelineStage>(
        model, local, held->modules, *held->strategy, held->units, ctx_.computing, plan_json,
        ctx_.strategy_options, scale_in_schedule ? float(1.0 / double(microbatches_)) : 1.0f,
        [this] { sample_activations(); });
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
  const int64_t share = train.global_batch_size / ctx_.data_parallel.size();
  const int64_t micro = ctx_.config.distributed.pipeline.pp_microbatch_size;
  const int64_t seq_len = ctx_.data.seq_len();
  ctx_.data.training_batch(uint64_t(train.seed), step, ctx_.data_parallel.rank() * share, share,
                           tokens_, targets_);
  for (auto& held : held_) {
    held->work->compute().set_shape(micro, seq_len);
    held->work->set_batch(tokens_.data(), targets_.data(), micro * seq_len);
    std::fill_n(held->local.grads, held->local.numel, 0.0f);
    held->work->compute().take_tensor_parallel_bytes();  // not this step's: validation's
    held->work->compute().take_context_parallel_traffic();
  }
  activations_.begin_step();
  const pipeline::StepTimes times = executor_->run_step();
  const auto sync_start = std::chrono::steady_clock::now();
  for (auto& held : held_) held->strategy->finish_gradients();
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
  // accumulated gradients are scaled here.
  if (!ctx_.config.distributed.pipeline.scale_grads_in_schedule) {
    const auto scale = float(1.0 / double(microbatches_));
    for (auto& held : held_) {
      for (int64_t i = 0; i < held->local.numel; ++i) held->local.grads[i] *= scale;
    }
  }
  double loss = 0;
  for (auto& held : held_) loss += held->work->take_loss_sum() / double(microbatches_);
  if (!counts_model_result()) loss = 0;
  metrics.loss = all_reduce(loss, ReduceOp::sum, ctx_.world) / double(ctx_.data_parallel.size());
}

double PipelineTrainer::gradient_norm() {
  // The shards of a stage partition it over the shard group, the stages
  // partition the model over the pipeline, and tp ranks hold pieces of the
  // sharded parameters; replicas hold equal shards.
  double squared = 0;
  for (auto& held : held_) {
    squared +=
        tensor_parallel_squared_norm(held->local, held->parameters.indices, tensor_parallel());
  }
  squared = all_reduce(squared, ReduceOp::sum, ctx_.shard_group);
  squared = all_reduce(squared, ReduceOp::sum, ctx_.pipeline);
  if (ctx_.computing.tp->size() > 1)
    squared = all_reduce(squared, ReduceOp::sum, *ctx_.computing.tp);
  return std::sqrt(squared);
}

void PipelineTrainer::optimizer_step(const StepMetrics& metrics) {
  for (auto& held : held_) {
    LocalParameters& local = held->local;
    clip_gradients(local.grads, local.numel, metrics.grad_norm, ctx_.config.train.max_grad_norm);
    held->optimizer->step(local.params, local.grads, metrics.lr);
    round_to(local.params, local.numel, ctx_.config.model.torch_dtype);
  }
}

std::optional<int64_t> PipelineTrainer::first_nonfinite_gradient() {
  std::optional<int64_t> first;
  for (auto& held : held_) {
    const auto found = train::first_nonfinite_gradient(held->local, held->parameters.indices);
    if (found && (!first || *found < *first)) first = found;
  }
  return first;
}

// One evaluation batch of `count` sequences (in tokens_/targets_) through
// the stages in order, activations passed on as they are made; the summed
// token losses on the rank of the last stage, else 0.
double PipelineTrainer::forward_for_evaluation(int64_t count) {
  const auto& split = ctx_.plan.model_plan.at("pipeline");
  const int64_t seq_len = ctx_.data.seq_len(), me = ctx_.pipeline.rank();
  std::vector<float> input, output;
  double sum = 0;
  auto held = held_.begin();
  for (size_t s = 0; s < split.size(); ++s) {
    if (split[s].at("rank").get<int64_t>() != me) continue;
    ModelStage& stage = (*held++)->work->compute();
    stage.set_shape(count, seq_len);
    input.resize(size_t(stage.input_numel()));
    const bool previous_here = s > 0 && split[s - 1].at("rank").get<int64_t>() == me;
    if (s > 0 && !previous_here) {
      FlatTensor tensor(input.data(), dtype_float32(), int64_t(input.size()));
      ctx_.pipeline.recv(tensor.get(), split[s - 1].at("rank").get<int64_t>(), int64_t(s)).wait();
    }
    if (previous_here) input.swap(output);
    output.resize(size_t(stage.output_numel()));
    const double loss =
        stage.forward(0, tokens_.data(), targets_.data(), input.empty() ? nullptr : input.data(),
                      output.empty() ? nullptr : output.data());
    stage.discard(0);
    if (s + 1 == split.size()) sum = loss * double(count * seq_len);
    if (s + 1 < split.size() && split[s + 1].at("rank").get<int64_t>() != me) {
      FlatTensor tensor(output.data(), dtype_float32(), int64_t(output.size()));
      ctx_.pipeline.send(tensor.get(), split[s + 1].at("rank").get<int64_t>(), int64_t(s + 1))
          .wait();
    }
  }
  return sum;
}

// Every tp and cp rank of the last stage has the loss of the same
// micro-batches (the model sums it over cp): tp and cp rank 0's counts, as
// do their copies of the stage's weights.
bool PipelineTrainer::counts_model_result() const {
  return ctx_.computing.tp->rank() == 0 && ctx_.computing.cp->rank() == 0;
}

std::optional<double> PipelineTrainer::validate() {
  const int64_t windows = ctx_.data.val_windows();
  if (windows == 0) return std::nullopt;
  const int64_t ranks = ctx_.data_parallel.size(), rank = ctx_.data_parallel.rank();
  const int64_t begin = rank * windows / ranks, end = (rank + 1) * windows / ranks;
  const int64_t micro = ctx_.config.distributed.pipeline.pp_microbatch_size;
  for (auto& held : held_) held->work->gather_for_evaluation();
  double sum = 0;
  for (int64_t first = begin; first < end; first += micro) {
    const int64_t count = std::min(micro, end - first);
    ctx_.data.validation_batch(first, count, tokens_, targets_);
    sum += forward_for_evaluation(count);
  }
  if (!counts_model_result()) sum = 0;
  return all_reduce(sum, ReduceOp::sum, ctx_.world) / double(windows * ctx_.data.seq_len());
}

MemoryUse PipelineTrainer::memory_use() {
  MemoryUse use;
  for (auto& held : held_) {
    const int64_t bytes = held->local.numel * int64_t(sizeof(float));
    const StrategyMemory strategy = held->strategy->memory();
    use.params += bytes;
    use.grads += bytes;
    use.optimizer += held->optimizer->state_bytes();
    use.buffers += strategy.buffers;
    use.buffers_peak += strategy.buffers_peak;
    use.buffers_reserved += strategy.buffers_reserved;
  }
  use.buffers_peak += executor_->peak_buffer_bytes();
  use.buffers_reserved += executor_->pooled_buffer_bytes();
  activations_.report(use);
  use.peak_rss = peak_rss_bytes();
  return use;
}

void PipelineTrainer::sample_activations() {
  int64_t bytes = 0;
  for (auto& held : held_) bytes += held->work->compute().activation_bytes();
  activations_.sample(bytes);
}

std::vector<HeldRange> PipelineTrainer::rank_ranges(bool saved) const {
  std::vector<HeldRange> ranges;
  if (saved && ctx_.replicate_group.rank() != 0) return ranges;
  int64_t base = 0;
  for (const auto& held : held_) {
    const auto stage =
        model_ranges(held->local.held, held->parameters, tensor_parallel(), saved, base);
    ranges.insert(ranges.end(), stage.begin(), stage.end());
    base += held->local.numel;
  }
  return ranges;
}

std::vector<ShardState> PipelineTrainer::shard_states() {
  std::vector<ShardState> shards;
  for (auto& held : held_) shards.push_back({&held->local, held->optimizer.get()});
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
      ctx_.world);
}

void PipelineTrainer::resume(const CheckpointIndex& index) {
  auto state = concatenated_state(shard_states());
  load_sharded(
      index, rank_ranges(false),
      {{"params", state[0].data()}, {"exp_avg", state[1].data()}, {"exp_avg_sq", state[2].data()}});
  scatter_state(state, shard_states());
  for (auto& held : held_) held->optimizer->restore(index.step);
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
    std::vector<float> stage(size_t(held->parameters.numel()));
    held->strategy->gather_parameters(stage.data(), int64_t(stage.size()));
    gather_tensor_parallel(held->parameters, stage.data(), tensor_parallel(), stage_full.data());
    if (ctx_.data_parallel.rank() != 0 || !counts_model_result()) continue;
    for (const int64_t p : held->parameters.indices) {
      const ModelParameter& parameter = description.parameters[size_t(p)];
      std::copy_n(stage_full.begin() + parameter.offset, parameter.numel,
                  full.begin() + parameter.offset);
    }
  }
  FlatTensor tensor(full.data(), dtype_float32(), int64_t(full.size()));
  ctx_.world.all_reduce(tensor.get(), ReduceOp::sum).wait();
  if (ctx_.world.rank() == 0) {
    export_consolidated(ctx_.output_dir, ctx_.config.model, description, full.data());
  }
}

void PipelineTrainer::run() {
  for (auto& held : held_) held->strategy->broadcast_parameters();
  run_training(ctx_.config, ctx_.plan.model->description(),
               ctx_.config.train.global_batch_size * ctx_.data.seq_len(), ctx_.world,
               ctx_.output_dir, next_step_, *this);
}

}  // namespace meshrun::train
