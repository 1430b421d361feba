#include "train/trainer.hpp"

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

std::unique_ptr<TimedHooks> make_hooks(const TrainContext& ctx) {
  if (!ctx.strategy.sharded()) {
    return std::make_unique<ReplicatedHooks>(ctx.strategy, ctx.parameters);
  }
  return std::make_unique<ShardedHooks>(ctx.strategy, ctx.units, ctx.parameters.indices,
                                        ctx.model.description().parameters.size(),
                                        unit_precision(ctx.config.distributed));
}

LocalParameters local_parameters(const TrainContext& ctx) {
  if (!ctx.strategy.sharded()) {
    FlatParameters& p = ctx.parameters;
    return replicated_parameters(p.values.data(), p.gradients.data(), p.offsets, ctx.data_parallel);
  }
  return sharded_parameters(ctx.strategy, ctx.shard_group, ctx.replicate_group);
}

}  // namespace

Trainer::Trainer(TrainContext context)
    : ctx_(std::move(context)),
      hooks_(make_hooks(ctx_)),
      stage_(ctx_.model, ctx_.modules, *hooks_, ctx_.computing, ctx_.plan_json, ctx_.options_json,
             &ctx_.tensor_parallel.local()),
      local_(local_parameters(ctx_)),
      model_held_(model_ranges(local_.held, ctx_.parameters, tensor_parallel(), false)),
      model_saved_(model_ranges(local_.saved, ctx_.parameters, tensor_parallel(), true)),
      optimizer_(ctx_.config.train,
                 decay_mask(local_, ctx_.model.description(), ctx_.parameters.indices)) {}

void Trainer::resume(const CheckpointIndex& index) {
  load_sharded(index, model_held_, checkpoint_buffers());
  optimizer_.restore(index.step);
  next_step_ = index.step;
}

std::vector<FlatBuffer> Trainer::checkpoint_buffers() {
  return {{"params", local_.params},
          {"exp_avg", optimizer_.exp_avg().data()},
          {"exp_avg_sq", optimizer_.exp_avg_sq().data()}};
}

double Trainer::all_reduce(double value, ReduceOp op) {
  auto single = float(value);
  FlatTensor tensor(&single, dtype_float32(), 1);
  ctx_.data_parallel.all_reduce(tensor.get(), op).wait();
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
  std::fill_n(local_.grads, local_.numel, 0.0f);
  hooks_->take_seconds_in_strategy();   // not this step's: validation's gathers
  stage_.take_tensor_parallel_bytes();  // likewise
  stage_.take_context_parallel_traffic();
  double loss_sum = 0.0;
  stage_.set_shape(train.micro_batch_size, ctx_.data.seq_len());
  activations_.begin_step();
  for (int64_t k = 0; k < micro_batches; ++k) {
    ctx_.strategy.begin_micro_batch(k == micro_batches - 1);
    ctx_.data.training_batch(uint64_t(train.seed), step, first + k * train.micro_batch_size,
                             train.micro_batch_size, tokens_, targets_);
    loss_sum += stage_.forward(0, tokens_.data(), targets_.data(), nullptr, nullptr);
    activations_.sample(stage_.activation_bytes());
    stage_.backward(0, 1.0f, nullptr, nullptr);
  }
  const auto sync_start = Clock::now();
  ctx_.strategy.finish_gradients();
  metrics.grad_sync_wait_s = seconds_since(sync_start);
  metrics.comm_wait_s = metrics.grad_sync_wait_s + hooks_->take_seconds_in_strategy();
  metrics.tp_bytes = stage_.take_tensor_parallel_bytes();
  const CommTraffic context = stage_.take_context_parallel_traffic();
  metrics.cp_bytes = context.bytes;
  metrics.cp_wait_s = context.wait_seconds;
  // Each micro-batch's loss is a mean over its tokens, so the accumulated
  // gradient is micro_batches times the mean over this rank's share; the
  // strategy averaged the shares, which makes it the global batch's mean.
  if (micro_batches > 1) {
    const auto scale = float(1.0 / double(micro_batches));
    for (int64_t i = 0; i < local_.numel; ++i) local_.grads[i] *= scale;
  }
  metrics.loss = all_reduce(loss_sum / double(micro_batches), ReduceOp::avg);
}

double Trainer::gradient_norm() {
  // A replicated strategy leaves the whole averaged gradient on every rank;
  // the shards of a sharded one partition it over the shard group (replicas
  // hold equal shards, so the replicate group adds nothing); tp ranks hold
  // pieces of the sharded parameters.
  double squared = tensor_parallel_squared_norm(local_, ctx_.parameters.indices, tensor_parallel());
  for (Communicator* group : {local_.norm_group, ctx_.computing.tp}) {
    if (group == nullptr || group->size() == 1) continue;
    auto share = float(squared);
    FlatTensor tensor(&share, dtype_float32(), 1);
    group->all_reduce(tensor.get(), ReduceOp::sum).wait();
    squared = share;
  }
  return std::sqrt(squared);
}

void Trainer::optimizer_step(const StepMetrics& metrics) {
  clip_gradients(local_.grads, local_.numel, metrics.grad_norm, ctx_.config.train.max_grad_norm);
  optimizer_.step(local_.params, local_.grads, metrics.lr);
  round_to(local_.params, local_.numel, ctx_.config.model.torch_dtype);
}

std::optional<int64_t> Trainer::first_nonfinite_gradient() {
  return train::first_nonfinite_gradient(local_, ctx_.parameters.indices);
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
  const int64_t forwards = ctx_.strategy.sharded() ? (most_windows + micro - 1) / micro : 0;
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
  return all_reduce(sum, ReduceOp::sum) / double(windows * seq_len);
}

// A forward of `count` sequences in tokens_/targets_ that keeps nothing.
double Trainer::evaluate(int64_t count) {
  stage_.set_shape(count, ctx_.data.seq_len());
  const double loss = stage_.forward(0, tokens_.data(), targets_.data(), nullptr, nullptr);
  stage_.discard(0);
  return loss;
}

void Trainer::save_checkpoint(int64_t step) {
  const auto dir =
      std::filesystem::path(ctx_.output_dir) / "checkpoints" / fmt::format("step_{}", step);
  save_sharded(dir.string(), checkpoint_layout(ctx_.config.model, ctx_.model.description()),
               ctx_.config.train.seed, step, model_saved_, checkpoint_buffers(), ctx_.world);
}

MemoryUse Trainer::memory_use() {
  const int64_t bytes = local_.numel * int64_t(sizeof(float));
  const StrategyMemory strategy = ctx_.strategy.memory();
  MemoryUse use{bytes,
                bytes,
                optimizer_.state_bytes(),
                strategy.buffers,
                strategy.buffers_peak,
                strategy.buffers_reserved};
  activations_.report(use);
  use.peak_rss = peak_rss_bytes();
  return use;
}

// The consolidated weights on rank 0; a sharded strategy gathers them first
// (collective over the shard group), then the tp ranks their pieces
// (collective over tp), so every rank comes here.
void Trainer::export_weights() {
  if (!ctx_.config.checkpoint.export_consolidated) return;
  const float* local = ctx_.parameters.values.data();
  std::vector<float> gathered, full(size_t(ctx_.model.description().numel));
  if (ctx_.strategy.sharded()) {
    gathered.resize(size_t(ctx_.parameters.numel()));
    ctx_.strategy.gather_parameters(gathered.data(), ctx_.parameters.numel());
    local = gathered.data();
  }
  gather_tensor_parallel(ctx_.parameters, local, tensor_parallel(), full.data());
  if (ctx_.world.rank() == 0) {
    export_consolidated(ctx_.output_dir, ctx_.config.model, ctx_.model.description(), full.data());
  }
}

void Trainer::run() {
  run_training(ctx_.config, ctx_.model.description(),
               ctx_.config.train.global_batch_size * ctx_.data.seq_len(), ctx_.world,
               ctx_.output_dir, next_step_, *this);
}

}  // namespace meshrun::train
