#include "train/trainer.hpp"
#include "trace/trace.hpp"

#include "train/experts.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

namespace meshrun::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The casts of the hidden states around a unit: FSDP2's mp_policy, a key of
// its own; any other sharded strategy computes in float32 throughout.
MixedPrecisionConfig unit_precision(const DistributedConfig& d) {
  if (d.strategy == "fsdp2") return d.mp_policy;
  return {"float32", "float32", "float32", false};
}

std::unique_ptr<TimedHooks> make_hooks(const TrainContext& ctx, StateDevice& state) {
  const TrainPart& dense = ctx.parts.front();
  if (!dense.strategy.sharded()) {
    return std::make_unique<ReplicatedHooks>(dense.strategy, dense.parameters);
  }
  std::vector<StrategyPart> parts;
  for (const TrainPart& part : ctx.parts) {
    parts.push_back({part.strategy, part.units, part.parameters.indices});
  }
  return std::make_unique<ShardedHooks>(parts, ctx.model.description().parameters.size(),
                                        unit_precision(ctx.config.distributed), state);
}

LocalParameters local_parameters(const TrainContext& ctx, const TrainPart& part) {
  if (!part.strategy.sharded()) {
    FlatParameters& p = part.parameters;
    return replicated_parameters(p.values.data(), p.gradients.data(), p.offsets, ctx.data_parallel);
  }
  return sharded_parameters(part.strategy, part.shard_group, part.replicate_group);
}

}  // namespace

Trainer::Part::Part(const TrainPart& spec, LocalParameters local, const Trainer& trainer)
    : spec(spec),
      local(std::move(local)),
      held(model_ranges(this->local.held, spec.parameters, trainer.tensor_parallel(), false)),
      saved(model_ranges(this->local.saved, spec.parameters, trainer.tensor_parallel(), true)),
      optimizer(trainer.ctx_.config.train,
                decay_mask(this->local, trainer.ctx_.model.description(), spec.parameters.indices),
                trainer.state_) {}

Trainer::Trainer(TrainContext context)
    : ctx_(std::move(context)),
      state_(ctx_.state),
      hooks_(make_hooks(ctx_, state_)),
      stage_(ctx_.model, ctx_.modules, *hooks_, ctx_.computing, ctx_.plan_json, ctx_.options_json,
             &ctx_.tensor_parallel.local(), StageDevice{state_.where(), state_.stream()}) {
  for (const TrainPart& part : ctx_.parts) {
    parts_.push_back(std::make_unique<Part>(part, local_parameters(ctx_, part), *this));
  }
}

std::vector<ShardState> Trainer::shard_states() {
  std::vector<ShardState> shards;
  for (auto& part : parts_) shards.push_back({&part->local, &part->optimizer});
  return shards;
}

std::vector<HeldRange> Trainer::checkpoint_ranges(bool saved) const {
  std::vector<HeldRange> ranges;
  int64_t base = 0;
  for (const auto& part : parts_) {
    for (HeldRange range : saved ? part->saved : part->held) {
      range.local_begin += base;
      ranges.push_back(range);
    }
    base += part->local.numel;
  }
  return ranges;
}

void Trainer::resume(const CheckpointIndex& index) {
  auto state = concatenated_state(shard_states());
  load_sharded(
      index, checkpoint_ranges(false),
      {{"params", state[0].data()}, {"exp_avg", state[1].data()}, {"exp_avg_sq", state[2].data()}});
  scatter_state(state, shard_states());
  for (auto& part : parts_) part->optimizer.restore(index.step);
  next_step_ = index.step;
}

double Trainer::all_reduce(double value, ReduceOp op, Communicator& over) {
  auto single = float(value);
  FlatTensor tensor(&single, dtype_float32(), 1);
  over.all_reduce(tensor.get(), op).wait();
  return single;
}

// Forward and backward over this rank's share of the global batch: the loss
// averaged over the global batch, and how long the step waited for the
// gradient reduction that backward did not hide.
void Trainer::train_step(int64_t step, StepMetrics& metrics) {
  const TrainConfig& train = ctx_.config.train;
  const int64_t share = train.global_batch_size / ctx_.data_parallel.size();
  const int64_t micro_batches = share / train.micro_batch_size;
  const int64_t first = ctx_.data_parallel.rank() * share;
  for (auto& part : parts_) state_.zero(part->local.grads, part->local.numel);
  hooks_->take_seconds_in_strategy();   // not this step's: validation's gathers
  stage_.take_tensor_parallel_bytes();  // likewise
  stage_.take_context_parallel_traffic();
  stage_.take_expert_parallel_traffic();
  double loss_sum = 0.0;
  stage_.set_shape(train.micro_batch_size, ctx_.data.seq_len());
  activations_.begin_step();
  for (int64_t k = 0; k < micro_batches; ++k) {
    for (auto& part : parts_) part->spec.strategy.begin_micro_batch(k == micro_batches - 1);
    ctx_.data.training_batch(uint64_t(train.seed), step, first + k * train.micro_batch_size,
                             train.micro_batch_size, tokens_, targets_);
    loss_sum += stage_.forward(0, copy_to_state(state_, tokens_, stage_tokens_),
                               copy_to_state(state_, targets_, stage_targets_), nullptr, nullptr);
    activations_.sample(stage_.activation_bytes());
    if (ctx_.gpu != nullptr) ctx_.gpu->sample_memory();
    stage_.backward(0, 1.0f, nullptr, nullptr);
  }
  const auto sync_start = Clock::now();
  {
    const trace::TraceSpan traced("finish_gradients", trace::kCommSpan);
    for (auto& part : parts_) part->spec.strategy.finish_gradients();
  }
  metrics.grad_sync_wait_s = seconds_since(sync_start);
  metrics.comm_wait_s = metrics.grad_sync_wait_s + hooks_->take_seconds_in_strategy();
  metrics.tp_bytes = stage_.take_tensor_parallel_bytes();
  const CommTraffic context = stage_.take_context_parallel_traffic();
  metrics.cp_bytes = context.bytes;
  metrics.cp_wait_s = context.wait_seconds;
  // Each micro-batch's loss is a mean over its tokens, so the accumulated
  // gradient is micro_batches times the mean over this rank's share; the
  // strategy averaged the shares, which makes it the global batch's mean.
  for (auto& part : parts_) {
    const auto scale = float(double(part->spec.gradient_scale) / double(micro_batches));
    if (scale != 1.0f) state_.scale(part->local.grads, part->local.numel, scale);
  }
  metrics.loss = all_reduce(loss_sum / double(micro_batches), ReduceOp::avg, ctx_.data_parallel);
  // The routers' load-balancing loss, a mean over the global batch as the
  // loss is, and the slots each expert took over every rank.
  metrics.moe = gather_expert_metrics(stage_.take_router_statistics(), ctx_.model.description(),
                                      double(micro_batches * ctx_.data_parallel.size()),
                                      stage_.take_expert_parallel_traffic(), ctx_.data_parallel);
}

double Trainer::gradient_norm() {
  // A replicated strategy leaves the whole averaged gradient on every rank;
  // the shards of a sharded one partition it over the shard group (replicas
  // hold equal shards, so the replicate group adds nothing), the ep ranks
  // hold different experts, and tp ranks hold pieces of the sharded
  // parameters.
  double squared = 0;
  for (auto& part : parts_) {
    double share = tensor_parallel_squared_norm(state_, part->local, part->spec.parameters.indices,
                                                tensor_parallel());
    for (Communicator* group : {part->local.norm_group, part->spec.norm_across}) {
      if (group != nullptr && group->size() > 1) share = all_reduce(share, ReduceOp::sum, *group);
    }
    squared += share;
  }
  if (ctx_.tensor_parallel_host.size() > 1) {
    squared = all_reduce(squared, ReduceOp::sum, ctx_.tensor_parallel_host);
  }
  return std::sqrt(squared);
}

void Trainer::optimizer_step(const StepMetrics& metrics) {
  for (auto& part : parts_) {
    LocalParameters& local = part->local;
    clip_gradients(state_, local.grads, local.numel, metrics.grad_norm,
                   ctx_.config.train.max_grad_norm);
    part->optimizer.step(local.params, local.grads, metrics.lr);
    state_.round_to(local.params, local.numel, ctx_.config.model.torch_dtype);
  }
}

std::optional<int64_t> Trainer::first_nonfinite_gradient() {
  std::optional<int64_t> first;
  for (auto& part : parts_) {
    const auto found =
        meshrun::first_nonfinite_gradient(state_, part->local, part->spec.parameters.indices);
    if (found && (!first || *found < *first)) first = found;
  }
  return first;
}

// docs/design.md's val_loss: the windows are shared out over the data-parallel
// ranks and the token losses summed over them. Under a sharded strategy a
// forward is collective (it gathers units), so a rank with fewer windows
// runs forwards of window 0 whose loss it drops, until every rank has run
// as many forwards as the rank with the most.
std::optional<double> Trainer::validate() {
  const int64_t windows = ctx_.data.val_windows();
  if (windows == 0) return std::nullopt;
  const int64_t ranks = ctx_.data_parallel.size(), rank = ctx_.data_parallel.rank();
  const int64_t begin = rank * windows / ranks, end = (rank + 1) * windows / ranks;
  const int64_t seq_len = ctx_.data.seq_len(), micro = ctx_.config.train.micro_batch_size;
  const int64_t most_windows = (windows + ranks - 1) / ranks;
  const int64_t forwards = sharded() ? (most_windows + micro - 1) / micro : 0;
  double sum = 0.0;
  int64_t done = 0;
  for (int64_t first = begin; first < end; first += micro, ++done) {
    const int64_t count = std::min(micro, end - first);
    ctx_.data.validation_batch(first, count, tokens_, targets_);
    sum += evaluate(count) * double(count * seq_len);
  }
  for (; done < forwards; ++done) {
    ctx_.data.validation_batch(0, 1, tokens_, targets_);
    evaluate(1);
  }
  return all_reduce(sum, ReduceOp::sum, ctx_.data_parallel) / double(windows * seq_len);
}

// A forward of `count` sequences in tokens_/targets_ that keeps nothing.
double Trainer::evaluate(int64_t count) {
  stage_.set_shape(count, ctx_.data.seq_len());
  const double loss =
      stage_.forward(0, copy_to_state(state_, tokens_, stage_tokens_),
                     copy_to_state(state_, targets_, stage_targets_), nullptr, nullptr);
  stage_.discard(0);
  return loss;
}

void Trainer::save_checkpoint(int64_t step) {
  auto state = concatenated_state(shard_states());
  const auto dir =
      std::filesystem::path(ctx_.output_dir) / "checkpoints" / fmt::format("step_{}", step);
  save_sharded(
      dir.string(), checkpoint_layout(ctx_.config.model, ctx_.model.description()),
      ctx_.config.train.seed, step, checkpoint_ranges(true),
      {{"params", state[0].data()}, {"exp_avg", state[1].data()}, {"exp_avg_sq", state[2].data()}},
      ctx_.world);
}

MemoryUse Trainer::memory_use() {
  MemoryUse use;
  for (auto& part : parts_) {
    const int64_t bytes = part->local.numel * int64_t(sizeof(float));
    const StrategyMemory strategy = part->spec.strategy.memory();
    use.params += bytes;
    use.grads += bytes;
    use.optimizer += part->optimizer.state_bytes();
    use.buffers += strategy.buffers;
    use.buffers_peak += strategy.buffers_peak;
    use.buffers_reserved += strategy.buffers_reserved;
  }
  if (parts_.size() > 1) {
    const Part& experts = *parts_.back();
    use.experts = MemoryUse::Experts{experts.local.numel * int64_t(sizeof(float)),
                                     experts.spec.strategy.memory().buffers_peak};
  }
  activations_.report(use);
  use.peak_rss = peak_rss_bytes();
  report_device_memory(ctx_.gpu, use);
  return use;
}

// The consolidated weights on rank 0: a sharded strategy gathers each part
// (collective over its shard group), then the tp ranks their pieces
// (collective over tp), so every rank comes here. With several parts each
// element has one writer (TrainPart::exports), and a sum over the world
// brings them to rank 0.
void Trainer::export_weights() {
  if (!ctx_.config.checkpoint.export_consolidated) return;
  const ModelDescription& description = ctx_.model.description();
  std::vector<float> full(size_t(description.numel), 0.0f), part_full(full.size());
  for (auto& part : parts_) {
    const FlatParameters& parameters = part->spec.parameters;
    const int64_t numel = parameters.numel();
    StateArray<float> gathered;
    float* values = parameters.values.data();
    if (part->spec.strategy.sharded()) {
      gathered = StateArray<float>(numel, state_);
      part->spec.strategy.gather_parameters(gathered.data(), numel);
      values = gathered.data();
    }
    HostView local(state_, values, numel);
    gather_tensor_parallel(parameters, local.data(), tensor_parallel(), part_full.data());
    if (!part->spec.exports) continue;
    for (const int64_t p : parameters.indices) {
      const ModelParameter& parameter = description.parameters[size_t(p)];
      std::copy_n(part_full.begin() + parameter.offset, parameter.numel,
                  full.begin() + parameter.offset);
    }
  }
  if (parts_.size() > 1) {
    FlatTensor tensor(full.data(), dtype_float32(), int64_t(full.size()));
    ctx_.world.all_reduce(tensor.get(), ReduceOp::sum).wait();
  }
  if (ctx_.world.rank() == 0) {
    export_consolidated(ctx_.output_dir, ctx_.config.model, description, full.data());
  }
}

void Trainer::broadcast_parameters() {
  for (auto& part : parts_) part->spec.strategy.broadcast_parameters();
}

void Trainer::run(const StepObserver& observer) {
  run_training(ctx_.config, ctx_.model.description(),
               ctx_.config.train.global_batch_size * ctx_.data.seq_len(), ctx_.world,
               ctx_.output_dir, ctx_.gemm_peak, next_step_, *this, observer);
}

}  // namespace meshrun::train
