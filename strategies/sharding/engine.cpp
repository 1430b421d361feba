#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>

#include "common/errors.hpp"
#include "common/setup_checks.hpp"

namespace meshrun::sharding {
namespace {

using strategies::Error;
using strategies::invalid;
using strategies::out_of_order;
using strategies::throw_if_error;

const char* phase_name(bool forward) { return forward ? "forward" : "backward"; }

// Appended piece by piece: GCC 12 at -O3 takes "'" + std::string(...) for
// an overlapping copy (a false -Wrestrict).
std::string parameter_name(const meshrun_strategy_setup& setup, int64_t p) {
  std::string quoted = "'";
  quoted += setup.parameter_names[p];
  quoted += '\'';
  return quoted;
}

// The shard and replicate groups of `setup`, with the replicate group's size.
Groups make_groups(const meshrun_strategy_setup& setup) {
  if (setup.shard_group == nullptr) invalid("setup: shard_group is NULL");
  if (setup.replicate_group == nullptr) invalid("setup: replicate_group is NULL");
  Groups groups{setup.comm, setup.shard_group, setup.replicate_group, 1};
  throw_if_error(setup.comm->size(setup.replicate_group, &groups.replicate_size),
                 "size of the replicate group");
  return groups;
}

// The most elements a layer unit (not the root) gathers: a double buffer's
// size.
int64_t largest_layer(const ShardLayout& layout, int32_t root) {
  int64_t largest = 0;
  for (int32_t u = 0; u < layout.num_units(); ++u) {
    if (u != root) largest = std::max(largest, layout.block(layout.unit(u).block).padded_numel);
  }
  return largest;
}

// Whether `setup` leaves the initial weights to the host (ABI 1.6); the
// values other than the two are refused.
bool weights_by_shard(const meshrun_strategy_setup& setup) {
  if (!MESHRUN_HAS_FIELD(meshrun_strategy_setup, &setup, initial_weights)) return false;
  if (setup.initial_weights != MESHRUN_INITIAL_WEIGHTS_RANK_ZERO &&
      setup.initial_weights != MESHRUN_INITIAL_WEIGHTS_BY_SHARD) {
    invalid("setup: initial_weights " + std::to_string(setup.initial_weights) +
            " is neither MESHRUN_INITIAL_WEIGHTS_RANK_ZERO (0) nor _BY_SHARD (1)");
  }
  return setup.initial_weights == MESHRUN_INITIAL_WEIGHTS_BY_SHARD;
}

// The units of `setup`, checked: every parameter in a unit that exists, its
// rows dividing its elements. Every unit in one block when `one_block`.
LayoutInput layout_input(const meshrun_strategy_setup& setup, bool one_block) {
  if (setup.num_units < 1) invalid("setup: num_units must be at least 1");
  if (setup.root_unit < 0 || setup.root_unit >= setup.num_units) {
    invalid("setup: root_unit " + std::to_string(setup.root_unit) + " is not in [0, " +
            std::to_string(setup.num_units) + ")");
  }
  const auto count = static_cast<size_t>(setup.num_parameters);
  if (count > 0 && (setup.parameter_units == nullptr || setup.parameter_rows == nullptr)) {
    invalid("setup: parameter_units or parameter_rows is NULL");
  }
  LayoutInput input{{setup.parameter_offsets, setup.parameter_offsets + count + 1},
                    {},
                    setup.num_units,
                    one_block};
  for (int64_t p = 0; p < setup.num_parameters; ++p) {
    const int32_t unit = setup.parameter_units[p];
    const int64_t rows = setup.parameter_rows[p];
    const int64_t numel = input.offsets[p + 1] - input.offsets[p];
    if (unit < 0 || unit >= setup.num_units) {
      invalid("setup: parameter " + parameter_name(setup, p) + " is in unit " +
              std::to_string(unit) + ", not in [0, " + std::to_string(setup.num_units) + ")");
    }
    if (rows < 0 || (rows == 0 ? numel != 0 : numel % rows != 0)) {
      invalid("setup: parameter " + parameter_name(setup, p) + " has " + std::to_string(numel) +
              " elements, which " + std::to_string(rows) + " rows do not divide");
    }
  }
  input.units.assign(setup.parameter_units, setup.parameter_units + count);
  return input;
}

}  // namespace

// ---- setup and the step ----

void Engine::setup(const meshrun_strategy_setup* setup) {
  if (layout_ != nullptr) out_of_order("setup was already called on this instance");
  strategies::check_setup(setup, MESHRUN_STRATEGY_SETUP_SIZE_1_3, "1.3");
  options_ = parse_(setup->options_json);
  groups_ = make_groups(*setup);
  const LayoutInput input = layout_input(*setup, options_.single_bucket);
  const bool by_shard = weights_by_shard(*setup);
  strategies::check_flat_float32(setup->parameters, "setup: parameters", input.offsets.back(),
                                 setup->comm->device_type, by_shard);
  use_device(*setup);
  int64_t ranks = 0;
  int64_t rank = 0;
  throw_if_error(setup->comm->size(setup->shard_group, &ranks), "size of the shard group");
  throw_if_error(setup->comm->rank(setup->shard_group, &rank), "rank in the shard group");
  auto layout = std::make_unique<const ShardLayout>(input, ranks, rank);

  offsets_ = input.offsets;
  parameter_names_.assign(setup->parameter_names, setup->parameter_names + setup->num_parameters);
  throw_if_error(setup->comm->rank(setup->data_parallel, &data_parallel_rank_),
                 "rank in the data-parallel group");
  local_numel_ = layout->local_numel();
  const size_t shard_bytes = static_cast<size_t>(local_numel_) * sizeof(float);
  shard_parameters_.allocate(shard_bytes, true);
  shard_gradients_.allocate(shard_bytes, true);
  device_->comm_follows_compute();
  if (!by_shard) shard_rank_zero_weights(*setup, *layout);
  device_->compute_follows_comm();
  segments_ = layout->segments();
  layout_ = std::move(layout);
  make_units(*setup);
  log(MESHRUN_LOG_DEBUG,
      std::to_string(setup->num_units) + " units, " + std::to_string(local_numel_) +
          " local shard elements of " + std::to_string(offsets_.back()) + ", param_dtype " +
          dtype_name(options_.param_dtype) + ", reduce_dtype " + dtype_name(options_.reduce_dtype));
}

// Host memory for a CPU comm backend, the GPU for a CUDA one; the engine
// computes on its buffers, so no other device will do.
void Engine::use_device(const meshrun_strategy_setup& setup) {
  const int32_t type = setup.comm->device_type;
  if (type != kDLCPU && type != kDLCUDA) {
    invalid("setup: the comm backend moves device type " + std::to_string(type) +
            " tensors; the sharded strategies keep their buffers on the CPU (1) or a CUDA GPU (2)");
  }
  device_ = make_device_(setup);
  meter_.use(*device_);
  shard_memory_.use(*device_);
}

// The shard of data-parallel rank 0's weights, as FSDP1's
// sync_module_states takes it: they are copied out here because the host may
// free its full weights after setup, and broadcast_parameters, which only
// equalizes replicas, could not bring shard-group ranks that started from
// other weights to rank 0's. They come in pieces, so that no rank holds a
// second full copy.
void Engine::shard_rank_zero_weights(const meshrun_strategy_setup& setup,
                                     const ShardLayout& layout) {
  int64_t rank = 0;
  throw_if_error(setup.comm->rank(setup.data_parallel, &rank), "rank in the data-parallel group");
  float* weights = reinterpret_cast<float*>(static_cast<std::byte*>(setup.parameters.data) +
                                            setup.parameters.byte_offset);
  const int64_t numel = offsets_.back();
  Buffer received(shard_memory_);
  if (rank != 0) received.allocate(size_t(std::min(numel, kWeightPiece)) * sizeof(float), false);
  for (int64_t begin = 0; begin < numel; begin += kWeightPiece) {
    int64_t count = std::min(kWeightPiece, numel - begin);
    // Rank 0 sends from the host's weights, which a broadcast leaves as they are.
    float* piece = rank == 0 ? weights + begin : received.floats();
    DLTensor tensor = flat_tensor(piece, device_->where(), Dtype::float32, count);
    throw_if_error(setup.comm->broadcast(setup.data_parallel, &tensor, 0, nullptr),
                   "broadcast of the weights from data-parallel rank 0");
    layout.shard(piece, begin, count, shard_parameters_.floats(), copy_on_device());
  }
  received.used_until(device_->record());
}

void Engine::log(int32_t level, const std::string& message) const {
  const std::string line = std::string(name_) + ": " + message;
  if (host_->log != nullptr) host_->log(host_->context, level, line.c_str());
}

void Engine::plan_memory(const meshrun_strategy_plan_input* input,
                         meshrun_strategy_memory_plan* out) const {
  const meshrun_strategy_setup setup = strategies::setup_of(input);
  const EngineOptions options = parse_(setup.options_json);
  const ShardLayout layout(layout_input(setup, options.single_bucket), input->shard_ranks, 0);
  strategies::write_memory_plan(
      out, layout.local_numel(),
      options.double_buffer ? 2 * largest_layer(layout, setup.root_unit) * int64_t{sizeof(float)}
                            : 0);
}

void Engine::make_units(const meshrun_strategy_setup& setup) {
  root_ = setup.root_unit;
  position_.assign(static_cast<size_t>(setup.num_units), -1);
  for (int32_t u = 0; u < setup.num_units; ++u) {
    if (u == root_) continue;
    position_[static_cast<size_t>(u)] = static_cast<int32_t>(layers_.size());
    layers_.push_back(u);
  }
  units_.resize(static_cast<size_t>(setup.num_units));
  for (int32_t u = 0; u < setup.num_units; ++u) {
    Unit& unit = units_[static_cast<size_t>(u)];
    const UnitSpan& span = layout_->unit(u);
    unit.bucket = span.block;
    unit.offset = span.begin;
    unit.numel = span.numel;
    unit.reshard_after_forward = reshards_after_forward(u);
  }
  make_buckets();
  if (options_.double_buffer) make_slots(largest_layer(*layout_, root_));
}

// A bucket per block of the layout: a bucket per unit, or one of every
// unit anchored at the root, whose backward is the step's last.
void Engine::make_buckets() {
  const int32_t count = layout_->num_blocks();
  buckets_.reserve(static_cast<size_t>(count));
  for (int32_t b = 0; b < count; ++b) {
    Bucket& bucket = buckets_.emplace_back(meter_);
    bucket.anchor = options_.single_bucket ? root_ : b;
    bucket.comm = {
        &layout_->block(b), layout_->ranks(),
        options_.single_bucket ? "every unit (one bucket)" : "unit " + std::to_string(b)};
  }
}

// Two gathered layer units at once is what one-ahead prefetch needs, and
// all double buffering can hold: every layer must be freed after its use.
void Engine::make_slots(int64_t numel) {
  const int64_t depth = std::max(options_.forward_prefetch_depth, options_.backward_prefetch_depth);
  if (options_.keep_parameters_gathered || options_.single_bucket ||
      (options_.prefetch && depth > 1)) {
    invalid(
        "double buffering holds two gathered layer units, but the options keep every unit "
        "gathered for the step, gather them as one bucket, or prefetch more than one unit ahead");
  }
  for (int i = 0; i < 2; ++i) {
    slots_.emplace_back(meter_).allocate(static_cast<size_t>(numel) * sizeof(float), false);
  }
}

// Kept gathered for the step (ZeRO-1 and -2), no unit reshards. Otherwise
// AutoModel's rule: the root keeps its parameters from forward to backward;
// an explicit reshard_after_forward applies to the other units; unset, no
// unit reshards under pipeline parallelism (a stage runs several forwards
// before their backwards), and otherwise every unit but the last, whose
// backward comes right after its forward.
bool Engine::reshards_after_forward(int32_t unit) const {
  if (unit == root_ || options_.keep_parameters_gathered) return false;
  if (options_.reshard_after_forward.has_value()) return *options_.reshard_after_forward;
  return options_.pp_size == 1 && unit != layers_.back();
}

void Engine::broadcast_parameters() {
  check_outside_step("broadcast_parameters");
  device_->comm_follows_compute();
  DLTensor shard = shard_tensor(shard_parameters_);
  throw_if_error(groups_.comm->broadcast(groups_.replicate, &shard, 0, nullptr),
                 "broadcast of the local shard from replicate-group rank 0");
  // Gathered copies of the old shard would be stale.
  reshard_all();
  device_->compute_follows_comm();
}

void Engine::begin_micro_batch(bool sync) {
  check_setup_done("begin_micro_batch");
  if (in_micro_batch_ && sync_) {
    out_of_order("begin_micro_batch after the step's sync micro-batch without finish_gradients");
  }
  check_between_units("begin_micro_batch");
  device_->comm_follows_compute();
  if (in_micro_batch_ && reduces_micro_batch()) reduce_held_gradients();
  replicate_started();
  poll();
  // A new step gathers from the shard as the optimizer left it, even where
  // a forward outside a step (evaluation) left units gathered.
  if (!in_micro_batch_) reshard_all();
  in_micro_batch_ = true;
  sync_ = sync;
}

void Engine::gradients_ready(int64_t begin, int64_t end) const {
  check_setup_done("gradients_ready");
  if (!in_micro_batch_) out_of_order("gradients_ready outside a micro-batch");
  // Gradients are reduced per unit, after post_backward: ranges are only
  // checked.
  strategies::first_parameter_of_range(offsets_, begin, end);
}

void Engine::finish_gradients() {
  check_setup_done("finish_gradients");
  if (!in_micro_batch_ || !sync_) {
    out_of_order(
        "finish_gradients without a sync micro-batch: begin the step's last micro-batch "
        "with sync = 1");
  }
  check_between_units("finish_gradients");
  device_->comm_follows_compute();
  // Deferred gradients of units the sync micro-batch's backward never
  // reached, and without overlap the micro-batch's.
  reduce_held_gradients();
  replicate_started();
  // Waited for on the host even on a device, so that a lost peer ends the
  // step within the comm timeout instead of stalling the GPU.
  while (!reductions_.empty()) finish_first_reduction();
  reshard_all();
  while (!settling_.empty()) {
    settling_.front().request.wait(settling_.front().what);
    settling_.pop_front();
  }
  device_->compute_follows_comm();
  in_micro_batch_ = false;
}

void Engine::memory(meshrun_strategy_memory* out) const {
  strategies::write_memory(out, meter_.now(), meter_.peak(), meter_.reserved());
}

// ---- the hooks ----

void Engine::pre_forward(int32_t u) { enter(u, Phase::forward); }

void Engine::post_forward(int32_t u) {
  const Unit& unit = leave(u, Phase::forward);
  device_->comm_follows_compute();
  poll();
  if (unit.reshard_after_forward) reshard(u);
}

void Engine::pre_backward(int32_t u) {
  enter(u, Phase::backward);
  Bucket& bucket = bucket_of(u);
  if (!bucket.gradients.held()) {
    bucket.gradients.allocate(static_cast<size_t>(bucket.comm.block->padded_numel) * sizeof(float),
                              true);
  }
}

void Engine::post_backward(int32_t u) {
  leave(u, Phase::backward);
  device_->comm_follows_compute();
  replicate_started();
  poll();
  Bucket& bucket = bucket_of(u);
  if (reduces_micro_batch() && options_.overlap_grad_reduce && bucket.anchor == u) {
    start_reduction(bucket);
  }
  if (!options_.keep_parameters_gathered) reshard(u);
}

bool Engine::reduces_micro_batch() const { return sync_ || !options_.defer_grad_sync; }

// Without overlap, the gradients a micro-batch reduces are reduced at its end.
void Engine::reduce_held_gradients() {
  for (Bucket& bucket : buckets_) {
    if (bucket.gradients.held()) start_reduction(bucket);
  }
}

// pre_forward and pre_backward: the unit gathered, the next ones prefetched.
Engine::Unit& Engine::enter(int32_t u, Phase phase) {
  const bool forward = phase == Phase::forward;
  const std::string call = std::string("pre_") + phase_name(forward);
  Unit& unit = unit_at(u, call.c_str());
  if (!forward && !in_micro_batch_) {
    out_of_order(call + " outside a micro-batch: call begin_micro_batch first");
  }
  check_idle(u, call.c_str());
  device_->comm_follows_compute();
  poll();
  unshard(u, forward ? forward_prefetch(u) : backward_prefetch(u));
  device_->compute_waits(bucket_of(u).ready.get());
  unit.phase = phase;
  return unit;
}

// post_forward and post_backward: the unit is out of its phase.
Engine::Unit& Engine::leave(int32_t u, Phase phase) {
  const char* name = phase_name(phase == Phase::forward);
  const std::string call = std::string("post_") + name;
  Unit& unit = unit_at(u, call.c_str());
  if (unit.phase != phase) {
    out_of_order(call + " of unit " + std::to_string(u) + " without its pre_" + name);
  }
  unit.phase = Phase::idle;
  return unit;
}

void Engine::check_gathered(int32_t u, const char* call) {
  if (!bucket_of(u).parameters.held()) {
    out_of_order(std::string(call) + ": unit " + std::to_string(u) +
                 " is not gathered (views exist between pre_forward and post_forward, and "
                 "between pre_backward and post_backward)");
  }
}

void Engine::unit_views(int32_t u, DLTensor* parameters, DLTensor* gradients) {
  Unit& unit = unit_at(u, "unit_views");
  check_gathered(u, "unit_views");
  const Bucket& bucket = bucket_of(u);
  if (parameters != nullptr) {
    *parameters = flat_tensor(bucket.parameters.floats() + unit.offset, device_->where(),
                              Dtype::float32, unit.numel);
  }
  if (gradients != nullptr) {
    const bool in_backward = unit.phase == Phase::backward;
    *gradients = flat_tensor(in_backward ? bucket.gradients.floats() + unit.offset : nullptr,
                             device_->where(), Dtype::float32, unit.numel);
  }
}

void Engine::unit_views_bfloat16(int32_t u, DLTensor* parameters) {
  Unit& unit = unit_at(u, "unit_views_bfloat16");
  check_gathered(u, "unit_views_bfloat16");
  if (parameters == nullptr) invalid("unit_views_bfloat16: parameters is NULL");
  const Buffer& received = bucket_of(u).received;
  auto* data = reinterpret_cast<uint16_t*>(received.data());
  *parameters = flat_tensor(received.held() ? data + unit.offset : nullptr, device_->where(),
                            Dtype::bfloat16, unit.numel);
}

void Engine::local_shard(DLTensor* parameters, DLTensor* gradients) {
  check_setup_done("local_shard");
  if (parameters != nullptr) *parameters = shard_tensor(shard_parameters_);
  if (gradients != nullptr) *gradients = shard_tensor(shard_gradients_);
}

void Engine::shard_segments(meshrun_shard_segment* segments, int64_t capacity,
                            int64_t* count) const {
  check_setup_done("shard_segments");
  if (count == nullptr) invalid("shard_segments: count is NULL");
  if (capacity < 0 || (segments == nullptr && capacity > 0)) {
    invalid("shard_segments: capacity " + std::to_string(capacity) +
            " must be >= 0, and 0 when segments is NULL");
  }
  const auto written = std::min(static_cast<size_t>(capacity), segments_.size());
  std::copy_n(segments_.begin(), written, segments);
  *count = static_cast<int64_t>(segments_.size());
}

void Engine::gather_parameters(DLTensor* full) {
  check_outside_step("gather_parameters");
  if (full == nullptr) invalid("gather_parameters: full is NULL");
  strategies::check_flat_float32(*full, "gather_parameters: full", offsets_.back(),
                                 device_->where().device_type);
  device_->comm_follows_compute();
  Buffer gathered(meter_);
  int64_t gathered_numel = layout_->ranks() * local_numel_;
  gathered.allocate(static_cast<size_t>(gathered_numel) * sizeof(float), false);
  const DLTensor send = shard_tensor(shard_parameters_);
  DLTensor recv = flat_tensor(gathered.data(), device_->where(), Dtype::float32, gathered_numel);
  throw_if_error(groups_.comm->all_gather(groups_.shard, &send, &recv, nullptr),
                 "all_gather of the local shards");
  layout_->unshard(
      gathered.floats(),
      reinterpret_cast<float*>(static_cast<std::byte*>(full->data) + full->byte_offset),
      copy_on_device());
  gathered.used_until(device_->record());
  device_->compute_follows_comm();
}

DLTensor Engine::shard_tensor(const Buffer& shard) {
  return flat_tensor(shard.data(), device_->where(), Dtype::float32, local_numel_);
}

CopyFloats Engine::copy_on_device() const {
  Device* device = device_.get();
  return [device](float* to, const float* from, int64_t count) { device->copy(to, from, count); };
}

// ---- checks ----

void Engine::check_setup_done(const char* call) const {
  if (layout_ == nullptr) out_of_order(std::string(call) + " before setup");
}

Engine::Unit& Engine::unit_at(int32_t unit, const char* call) {
  check_setup_done(call);
  if (unit < 0 || unit >= static_cast<int32_t>(units_.size())) {
    throw Error(MESHRUN_OUT_OF_RANGE, std::string(call) + ": unit " + std::to_string(unit) +
                                          " is not in [0, " + std::to_string(units_.size()) + ")");
  }
  return units_[static_cast<size_t>(unit)];
}

void Engine::check_idle(int32_t unit, const char* call) const {
  const Phase phase = units_[static_cast<size_t>(unit)].phase;
  if (phase == Phase::idle) return;
  const bool forward = phase == Phase::forward;
  out_of_order(std::string(call) + " of unit " + std::to_string(unit) + ", which is in its " +
               phase_name(forward) + " (no post_" + phase_name(forward) + " since)");
}

// No unit between its pre_* and post_* hooks.
void Engine::check_between_units(const char* call) const {
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].phase == Phase::idle) continue;
    const bool forward = units_[u].phase == Phase::forward;
    out_of_order(std::string(call) + " while unit " + std::to_string(u) + " is in its " +
                 phase_name(forward) + " (no post_" + phase_name(forward) + " yet)");
  }
}

void Engine::check_outside_step(const char* call) const {
  check_setup_done(call);
  if (in_micro_batch_) {
    out_of_order(std::string(call) + " during a step (before its finish_gradients)");
  }
  check_between_units(call);
}

// ---- unsharding ----

std::vector<int32_t> Engine::forward_prefetch(int32_t unit) const {
  const int64_t depth = options_.prefetch ? options_.forward_prefetch_depth : 0;
  // The root (position -1) runs before the first layer.
  const int64_t first = position_[static_cast<size_t>(unit)] + 1;
  const int64_t end = std::min(first + depth, static_cast<int64_t>(layers_.size()));
  return {layers_.begin() + first, layers_.begin() + std::max(first, end)};
}

std::vector<int32_t> Engine::backward_prefetch(int32_t unit) const {
  const int64_t depth = options_.prefetch ? options_.backward_prefetch_depth : 0;
  // Backward visits the layers last to first, after the root's head.
  const int64_t end =
      unit == root_ ? static_cast<int64_t>(layers_.size()) : position_[static_cast<size_t>(unit)];
  std::vector<int32_t> units;
  for (int64_t p = end - 1; p >= std::max<int64_t>(end - depth, 0); --p) {
    units.push_back(layers_[static_cast<size_t>(p)]);
  }
  return units;
}

// Starts the unit's gather, then the prefetches, and waits for the unit's.
void Engine::unshard(int32_t unit, const std::vector<int32_t>& prefetch) {
  start_gather(unit);
  for (int32_t next : prefetch) start_gather(next);
  complete_gather(units_[static_cast<size_t>(unit)].bucket);
}

// Whether a unit is gathered or in flight is the same on every rank (it
// follows the hooks), so every rank starts the same gathers in one order.
void Engine::start_gather(int32_t u) {
  Bucket& bucket = bucket_of(u);
  if (bucket.parameters.held() || bucket.gather.has_value()) return;
  // A root holding no parameter (its embedding and head are units of their
  // own) has nothing to move.
  if (bucket.comm.block->full_numel == 0) {
    bucket.parameters.allocate(0, false);
    return;
  }
  // A device unpacks when the gather starts, so it takes the gather buffer
  // (double buffering) then; the host when the gather completes.
  const int32_t b = units_[static_cast<size_t>(u)].bucket;
  Buffer* slot = device_->orders_work_after_collectives() ? held_slot(b) : nullptr;
  bucket.gather.emplace(groups_, bucket.comm, shard_parameters_.floats(), options_.param_dtype,
                        meter_, slot);
}

void Engine::complete_gather(int32_t b) {
  Bucket& bucket = buckets_[static_cast<size_t>(b)];
  if (!bucket.gather.has_value()) return;
  if (!device_->orders_work_after_collectives()) {
    if (Buffer* slot = held_slot(b)) bucket.parameters.swap(*slot);
  }
  strategies::Request in_flight = bucket.gather->finish(bucket.parameters, bucket.received);
  bucket.ready = bucket.gather->ready();
  if (in_flight.pending()) settling_.push_back({std::move(in_flight), bucket.gather->what()});
  bucket.gather.reset();
}

// The gather buffer of bucket `b` (double buffering), taken back from an
// idle holder if need be; NULL without double buffering.
Buffer* Engine::held_slot(int32_t b) {
  Buffer* slot = slot_of(b);
  if (slot != nullptr && !slot->held()) free_slot(slot, b);
  return slot;
}

// A slot still lent to an idle unit (the last unit, kept gathered after a
// forward that had no backward: evaluation) is taken back: that unit is
// gathered again when next used. A unit computing keeps its slot.
void Engine::free_slot(Buffer* slot, int32_t b) {
  for (int32_t holder = 0; holder < static_cast<int32_t>(buckets_.size()); ++holder) {
    if (holder == b || slot_of(holder) != slot || !buckets_[size_t(holder)].parameters.held()) {
      continue;
    }
    if (units_[static_cast<size_t>(holder)].phase == Phase::idle) {
      release_bucket(holder);
      return;
    }
  }
  throw Error(MESHRUN_INTERNAL, "double buffering: unit " + std::to_string(b) +
                                    "'s gather buffer is still held by a unit computing");
}

// Layer units alternate between the two buffers in forward order, so the
// units around one in use (prefetched, just freed) never share its buffer.
// (Double buffering keeps a bucket per unit.)
Buffer* Engine::slot_of(int32_t b) {
  if (slots_.empty() || b == root_) return nullptr;
  return &slots_[static_cast<size_t>(position_[static_cast<size_t>(b)] % 2)];
}

// A unit's reshard frees its bucket's parameters when it anchors the bucket.
void Engine::reshard(int32_t u) {
  const int32_t b = units_[static_cast<size_t>(u)].bucket;
  if (buckets_[static_cast<size_t>(b)].anchor == u) release_bucket(b);
}

void Engine::release_bucket(int32_t b) {
  buckets_[static_cast<size_t>(b)].received.release();
  Buffer& parameters = buckets_[static_cast<size_t>(b)].parameters;
  Buffer* slot = slot_of(b);
  if (slot != nullptr && parameters.held()) {
    parameters.swap(*slot);
  } else {
    parameters.release();
  }
}

// Every bucket sharded, its gathers complete.
void Engine::reshard_all() {
  for (int32_t b = 0; b < static_cast<int32_t>(buckets_.size()); ++b) {
    complete_gather(b);
    release_bucket(b);
  }
}

// ---- gradient reduction ----

void Engine::check_finite_gradients(const Bucket& bucket) const {
  const float* gradients = bucket.gradients.floats();
  for (const ParameterPlace& place : bucket.comm.block->parameters) {
    const strategies::NonFinite found =
        device_->first_non_finite(gradients + place.block_begin, place.numel);
    if (found.index < 0) continue;
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "report_nan_in_param_grad: the gradient of '" +
                    parameter_names_[static_cast<size_t>(place.parameter)] + "' holds " +
                    std::to_string(found.value) + " (element " + std::to_string(found.index) +
                    ") on data-parallel rank " + std::to_string(data_parallel_rank_) +
                    ", before its reduction");
  }
}

// Frees the bucket's gradients once the reduction has them (in float32,
// as its send buffer).
void Engine::start_reduction(Bucket& bucket) {
  if (bucket.comm.block->full_numel == 0) {
    bucket.gradients.release();
    return;
  }
  if (options_.report_nan_in_param_grad) check_finite_gradients(bucket);
  const bool average = options_.average_in_collective;
  const float scale =
      average ? 1.0f : 1.0f / static_cast<float>(layout_->ranks() * groups_.replicate_size);
  reductions_.emplace_back(groups_, bucket.comm, bucket.gradients, options_.reduce_dtype,
                           average ? MESHRUN_REDUCE_AVG : MESHRUN_REDUCE_SUM, scale,
                           shard_gradients_.floats(), meter_);
  bucket.gradients.release();
}

// Starts the HSDP all-reduce of every reduction started so far: at fixed
// points, in start order, so that every rank issues them alike.
void Engine::replicate_started() {
  for (Reduction& reduction : reductions_) {
    if (reduction.awaits_replication()) reduction.replicate();
  }
}

// Reductions complete in start order, so every replica of a shard adds the
// same results in the same order and the replicas stay bit-identical.
void Engine::finish_first_reduction() {
  reductions_.front().finish();
  reductions_.pop_front();
}

// Completes whatever communication has finished: copies out, no new
// collectives.
// Reductions first: what they free is then free before completed gathers
// take their float32 (and bfloat16) buffers.
void Engine::poll() {
  while (!reductions_.empty() && reductions_.front().done()) finish_first_reduction();
  while (!settling_.empty() && settling_.front().request.test(settling_.front().what)) {
    settling_.pop_front();
  }
  for (int32_t b = 0; b < static_cast<int32_t>(buckets_.size()); ++b) {
    Bucket& bucket = buckets_[static_cast<size_t>(b)];
    if (bucket.gather.has_value() && bucket.gather->done()) complete_gather(b);
  }
}

}  // namespace meshrun::sharding
