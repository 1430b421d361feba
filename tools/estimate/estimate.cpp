#include "estimate/estimate.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "bench/comm_bench.hpp"
#include "errors.hpp"
#include "numeric/peak.hpp"
#include "simulate/simulate.hpp"
#include "strategy/strategy.hpp"

namespace meshrun {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Published and measured capacities (docs/plan.md, "Estimates", says where
// each figure comes from). GEMM rates are what large GEMMs sustain, not the
// datasheet peak: 989 TFLOP/s dense bfloat16 on an H100 SXM sustains about
// 700 in cuBLAS; float32 matmuls run on TF32 tensor cores.
HardwareProfile h100_sxm() {
  return {"h100-sxm", 380e12, 700e12, 3.0e12, 80 * kGiB, 360e9, 45e9, 8, true};
}
HardwareProfile h200() { return {"h200", 380e12, 700e12, 4.3e12, 141e9, 360e9, 45e9, 8, true}; }

int64_t usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// This machine, measured now: each core's GEMM rate and one core's memcpy
// bandwidth, shared by the ranks of a node when they outnumber the cores.
// Shared-memory collectives reach 0.24x memcpy (64 MiB all_reduce, 2 ranks:
// 3.6-3.9 GB/s against 16 GB/s); across simulated nodes MPI over TCP
// reaches 1 GB/s busbw (tests/bench/hierarchical_allreduce.py).
HardwareProfile cpu_this_machine(int64_t ranks_per_node) {
  const int64_t cores = usable_cores();
  const int64_t ranks = std::max<int64_t>(ranks_per_node, 1);
  const double share = double(std::min(cores, ranks)) / double(ranks);
  constexpr double kSeconds = 0.05;
  const double memcpy = run_memcpy_bench({int64_t(64) << 20}, kSeconds).front().gbps * 1e9;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return {"cpu-this-machine",
          gemm_flops_per_s("float32", kSeconds) * share,
          gemm_flops_per_s("bfloat16", kSeconds) * share,
          memcpy * share,
          double(pages) * double(page) / double(ranks),
          0.24 * memcpy * share,
          1e9 * share,
          ranks,
          false,
          true,
          share};
}

[[noreturn]] void bad_profile(const std::string& file, const toml::source_region& where,
                              const std::string& what) {
  throw invalid_argument(
      fmt::format("{}:{}:{}: {}", file, where.begin.line, where.begin.column, what));
}

double positive(const toml::table& table, const std::string& file, const char* key) {
  const toml::node* node = table.get(key);
  const auto value = node ? node->value<double>() : std::nullopt;
  if (!value || !(*value > 0) || !std::isfinite(*value)) {
    bad_profile(file, node ? node->source() : table.source(),
                fmt::format("{}: expected a positive number", key));
  }
  return *value;
}

// A profile file: the fields of HardwareProfile, every one required.
HardwareProfile profile_from_file(const std::string& file) {
  toml::table table;
  try {
    table = toml::parse_file(file);
  } catch (const toml::parse_error& error) {
    bad_profile(file, error.source(), std::string(error.description()));
  }
  static const char* const kKeys[] = {"name",
                                      "ranks_per_node",
                                      "matmul_flops_per_s_float32",
                                      "matmul_flops_per_s_bfloat16",
                                      "memory_bandwidth_bytes_per_s",
                                      "memory_bytes",
                                      "intra_node_busbw_bytes_per_s",
                                      "inter_node_busbw_bytes_per_s",
                                      "overlaps_communication"};
  for (const auto& [key, node] : table) {
    if (std::find(std::begin(kKeys), std::end(kKeys), key.str()) == std::end(kKeys)) {
      bad_profile(file, node.source(),
                  fmt::format("unknown key '{}'; valid keys: {}", key.str(),
                              fmt::join(std::begin(kKeys), std::end(kKeys), ", ")));
    }
  }
  HardwareProfile profile;
  profile.name = table["name"].value_or(file);
  profile.ranks_per_node = int64_t(positive(table, file, "ranks_per_node"));
  profile.matmul_flops_float32 = positive(table, file, "matmul_flops_per_s_float32");
  profile.matmul_flops_bfloat16 = positive(table, file, "matmul_flops_per_s_bfloat16");
  profile.memory_bandwidth = positive(table, file, "memory_bandwidth_bytes_per_s");
  profile.memory_bytes = positive(table, file, "memory_bytes");
  profile.intra_node_busbw = positive(table, file, "intra_node_busbw_bytes_per_s");
  profile.inter_node_busbw = positive(table, file, "inter_node_busbw_bytes_per_s");
  const toml::node* overlap = table.get("overlaps_communication");
  if (overlap && !overlap->is_boolean()) {
    bad_profile(file, overlap->source(), "overlaps_communication: expected true or false");
  }
  profile.overlaps_communication = overlap ? overlap->value_or(true) : true;
  return profile;
}

// ---- where the parameters and layers are ----

// What one pipeline rank holds: its parameters (tp-local elements), layers,
// whether it embeds and whether it holds the head.
struct RankShare {
  int64_t numel = 0;
  int64_t layers = 0;
  bool embedding = false, head = false;
  int64_t largest_unit = 0;  // tp-local elements of its largest unit
  // Tp-local elements a sharded strategy holds gathered at once at most:
  // the root (kept gathered for the step) and the most that `window`
  // consecutive units in forward order hold (the one computing and those
  // prefetched).
  int64_t gathered_peak = 0;
  // Tp-local elements of the two consecutive units that hold the most: a
  // unit's gradients while the one after it is still being reduced.
  int64_t reducing_peak = 0;
};

// The units gathered at once by a sharded strategy: the one computing and
// those prefetched (fsdp2's deeper backward prefetch, Megatron-FSDP's one
// ahead with overlap_param_gather); under a pipeline, or Megatron-FSDP
// below ZeRO-3 (which keeps parameters gathered), every unit of the rank's
// stages, gathered for the whole step.
int64_t gathered_window(const Plan& plan) {
  const DistributedConfig& d = plan.config->distributed;
  if (plan.mesh.axis_size(Axis::pp) > 1) return std::numeric_limits<int32_t>::max();
  if (d.strategy == "megatron_fsdp" && d.zero_dp_strategy < 3) {
    return std::numeric_limits<int32_t>::max();
  }
  if (d.strategy == "fsdp2" && d.enable_fsdp2_prefetch) {
    return 1 + std::max(d.fsdp2_forward_prefetch_depth, d.fsdp2_backward_prefetch_depth);
  }
  return d.strategy == "megatron_fsdp" && d.overlap_param_gather ? 2 : 1;
}

// The share's layers, largest unit and gathered peak from the units it
// holds (held_units, in description order).
void count_units(const ModelDescription& local, const std::vector<int64_t>& unit_numel,
                 const std::vector<int32_t>& held_units, int64_t window, RankShare& share) {
  const auto held = [&](int32_t u) {
    return std::find(held_units.begin(), held_units.end(), u) != held_units.end();
  };
  std::vector<int64_t> in_order;
  for (const int32_t u : local.forward_units()) {
    if (held(u)) in_order.push_back(unit_numel[size_t(u)]);
    share.layers += held(u) && local.is_layer_unit(u) ? 1 : 0;
  }
  const auto most_in_window = [&](int64_t units) {
    int64_t most = 0;
    for (size_t first = 0; first < in_order.size(); ++first) {
      const size_t end = std::min(in_order.size(), first + size_t(units));
      most = std::max(most, std::accumulate(in_order.begin() + ptrdiff_t(first),
                                            in_order.begin() + ptrdiff_t(end), int64_t{0}));
    }
    return most;
  };
  const int64_t root = held(local.root_unit()) ? unit_numel[size_t(local.root_unit())] : 0;
  share.gathered_peak = std::max(share.gathered_peak, most_in_window(window) + root);
  share.reducing_peak = std::max(share.reducing_peak, most_in_window(2));
  for (const int32_t u : held_units) {
    share.largest_unit = std::max(share.largest_unit, unit_numel[size_t(u)]);
  }
}

std::vector<RankShare> rank_shares(const Plan& plan) {
  const ModelDescription& local = plan.tensor_parallel->local();
  const int64_t window = gathered_window(plan);
  std::vector<int64_t> unit_numel(local.units.size(), 0);
  for (const ModelParameter& p : local.parameters) unit_numel[size_t(p.unit)] += p.numel;
  const auto& split = plan.model_plan.value("pipeline", nlohmann::ordered_json());
  if (split.is_null() || split.empty()) {
    RankShare share{local.numel, 0, true, true, 0, 0, 0};
    std::vector<int32_t> all(local.units.size());
    std::iota(all.begin(), all.end(), 0);
    count_units(local, unit_numel, all, window, share);
    return {share};
  }
  std::vector<RankShare> shares(size_t(plan.mesh.axis_size(Axis::pp)));
  for (const auto& stage : split) {
    RankShare& share = shares.at(stage.at("rank").get<size_t>());
    const StageContents contents =
        stage_contents(*plan.model, stage.at("modules").get<std::vector<std::string>>());
    for (const int64_t p : contents.parameters) share.numel += local.parameters[size_t(p)].numel;
    const int64_t gathered = share.gathered_peak;
    share.gathered_peak = 0;
    count_units(local, unit_numel, contents.units, window, share);
    share.gathered_peak += gathered;
    share.embedding = share.embedding || stage.at("stage").get<int64_t>() == 0;
    share.head = share.head || stage.at("stage").get<size_t>() + 1 == split.size();
  }
  return shares;
}

// ---- memory ----

int64_t stages_per_rank(const Plan& plan) {
  const auto& split = plan.model_plan.value("pipeline", nlohmann::ordered_json());
  const int64_t pp = plan.mesh.axis_size(Axis::pp);
  return split.is_array() && !split.empty() ? int64_t(split.size()) / pp : 1;
}

// The schedule's simulation with a backward twice the forward: its bubble
// and the microbatch activations a rank holds at its peak.
schedule::Simulation simulate_schedule(const Plan& plan) {
  const Config& config = *plan.config;
  const int64_t pp = plan.mesh.axis_size(Axis::pp);
  const int64_t per_rank = stages_per_rank(plan);
  const int64_t microbatches = pipeline_microbatches(config, plan.mesh.axis_size(Axis::dp));
  const std::string& csv = config.distributed.pipeline.pp_schedule_csv;
  const schedule::Schedule compute =
      csv.empty() ? schedule::generate(*plan.schedule, pp, per_rank, microbatches)
                  : schedule::read_csv(csv, pp, per_rank, microbatches);
  return schedule::simulate(compute, schedule::Costs{1, 2, 1, 1, 0, 0});
}

// Elements a rank keeps per token of one microbatch in `mode`, with the
// token ids and targets (int32).
double kept_per_token(const ModelDescription::Activations& a, const RankShare& share,
                      const std::string& mode, int64_t tp, bool sequence_parallel) {
  const double split = 1.0 / double(tp);
  double layer = 0;
  if (mode == "none") layer = double(a.layer.whole) + double(a.layer.tp_split) * split;
  if (mode == "selective") {
    layer = double(a.layer.whole - a.elementwise.whole) +
            double(a.layer.tp_split - a.elementwise.tp_split) * split;
  }
  const double stream = double(a.stream) * (sequence_parallel ? split : 1.0);
  double total =
      double(share.layers) * layer + double(share.layers + (share.head ? 1 : 0)) * stream;
  if (share.head) total += double(a.head.whole) + double(a.head.tp_split) * split + 1;  // + targets
  if (share.embedding) total += 1;  // the token ids (int32)
  return total;
}

ModelDescription::PerToken minus(const ModelDescription::PerToken& a,
                                 const ModelDescription::PerToken& b) {
  return {a.whole - b.whole, a.tp_split - b.tp_split};
}

// Elements per token of one microbatch a rank keeps in bfloat16 in `mode`
// when its matmuls compute in bfloat16 (the model's description says
// which it keeps in float32).
double bfloat16_kept_per_token(const ModelDescription::Activations& a, const RankShare& share,
                               const std::string& mode, int64_t tp, bool sequence_parallel) {
  const ModelDescription::KeptInFloat32& f = *a.float32;
  const ModelDescription::Activations in_bfloat16{
      minus(a.layer, f.layer), minus(a.elementwise, f.elementwise), 0, minus(a.head, f.head), {}};
  const double ids = (share.head ? 1.0 : 0.0) + (share.embedding ? 1.0 : 0.0);
  return kept_per_token(in_bfloat16, share, mode, tp, sequence_parallel) - ids;
}

// Bytes a rank keeps per token of one microbatch in `mode`: float32, or
// with bfloat16 matmuls what the model keeps in bfloat16 at 2 bytes (the
// stream, token ids and targets stay 4).
double kept_bytes_per_token(const ModelDescription::Activations& a, const RankShare& share,
                            const std::string& mode, int64_t tp, bool sequence_parallel,
                            bool bfloat16) {
  if (!bfloat16 || !a.float32) return 4.0 * kept_per_token(a, share, mode, tp, sequence_parallel);
  const ModelDescription::KeptInFloat32& f = *a.float32;
  const ModelDescription::Activations in_float32{f.layer, f.elementwise, a.stream, f.head, {}};
  return 4.0 * kept_per_token(in_float32, share, mode, tp, sequence_parallel) +
         2.0 * bfloat16_kept_per_token(a, share, mode, tp, sequence_parallel);
}

std::optional<int64_t> activation_bytes(const Plan& plan, const RankShare& share,
                                        const std::string& mode, int64_t microbatches_held) {
  const auto& activations = plan.model->description().activations;
  if (!activations) return std::nullopt;
  const Config& config = *plan.config;
  const int64_t tp = plan.mesh.axis_size(Axis::tp);
  const bool sp = config.distributed.sequence_parallel;
  const bool bfloat16 = matmul_dtype(config, plan.model->description()) == "bfloat16";
  const int64_t batch = plan.mesh.axis_size(Axis::pp) > 1
                            ? config.distributed.pipeline.pp_microbatch_size
                            : config.train.micro_batch_size;
  const double rows = double(batch * config.data.seq_len) / double(plan.mesh.axis_size(Axis::cp));
  double bytes = rows * kept_bytes_per_token(*activations, share, mode, tp, sp, bfloat16) *
                 double(microbatches_held);
  // A fully recomputed layer's backward runs in one float32 scratch layer
  // and output (a layer's stream); with bfloat16 activations the layer but
  // for its float32 part is in the working buffers every layer computes in
  // (not counted).
  const ModelDescription::PerToken& scratch =
      bfloat16 && activations->float32 ? activations->float32->layer : activations->layer;
  if (mode == "full" && share.layers > 0) {
    const double output = double(activations->stream) / (sp ? double(tp) : 1.0);
    bytes += 4.0 * rows * (double(scratch.whole) + double(scratch.tp_split) / double(tp) + output);
  }
  return int64_t(bytes);
}

std::string checkpointing_mode(const Config& config) {
  const std::string& mode = config.distributed.activation_checkpointing;
  return mode.empty() ? "none" : mode;
}

// Bytes of one gathered parameter element: the dtype a sharded strategy
// gathers in.
// Whether the sharded strategy keeps the micro-batches' gradients whole
// until the step's last one, as fsdp2 does with defer_fsdp_grad_sync (its
// default) and megatron_fsdp at ZeRO-0 and -1, in a step of several
// micro-batches.
bool defers_gradient_sync(const Plan& plan) {
  const Config& config = *plan.config;
  const DistributedConfig& d = config.distributed;
  const bool defers = (d.strategy == "fsdp2" && d.defer_fsdp_grad_sync) ||
                      (d.strategy == "megatron_fsdp" && d.zero_dp_strategy <= 1);
  const int64_t per_step = config.train.global_batch_size /
                           (plan.mesh.axis_size(Axis::dp) * config.train.micro_batch_size);
  return defers && per_step > 1;
}

int64_t gathered_bytes(const Config& config) {
  return config.distributed.strategy == "fsdp2" &&
                 config.distributed.mp_policy.param_dtype == "bfloat16"
             ? 2
             : 4;
}

// Bytes a sharded strategy holds gathered at its peak: the units gathered
// at once (RankShare::gathered_peak) in float32 (the copy computed with; a
// float32 gather receives into it) and, gathered in another dtype, in that
// dtype too (what the gather received, which a bfloat16 gather keeps for
// the matmuls while the unit is gathered), and the float32 gradients of
// two consecutive units (RankShare::reducing_peak): one computing its
// backward while the one after it is reduce-scattered. Under a pipeline
// every unit of the stages stays gathered with its float32 gradients for
// the step's backwards, and one unit at a time is in flight. A strategy
// that defers the reduction to the step's last micro-batch
// (defers_gradient_sync) holds every unit's float32 gradients from the
// first micro-batch on, and then a unit's reduced shard as well. Checked
// against mem.buffers_peak of runs (docs/plan.md, "Estimates").
int64_t gathered_buffer_bytes(const Plan& plan, const RankShare& share) {
  const int64_t gathered = gathered_bytes(*plan.config);
  const int64_t received = gathered == 4 ? 0 : gathered;
  if (plan.mesh.axis_size(Axis::pp) > 1) {
    return share.gathered_peak * (4 + 4 + received) + share.largest_unit * 4;
  }
  if (defers_gradient_sync(plan)) {
    const int64_t shards = std::max<int64_t>(1, plan.mesh.axis_size(Axis::dp_shard_cp));
    return share.gathered_peak * (4 + received) + share.numel * 4 + share.largest_unit * 4 / shards;
  }
  return share.gathered_peak * (4 + received) + share.reducing_peak * 4;
}

MemoryEstimate estimate_memory(const Plan& plan, const std::optional<StrategyMemoryPlan>& predicted,
                               const RankShare& share, int64_t held) {
  MemoryEstimate memory;
  const ModelDescription& local = plan.tensor_parallel->local();
  const double fraction = double(share.numel) / double(std::max<int64_t>(local.numel, 1));
  const int64_t updated =
      predicted ? int64_t(double(predicted->local_numel) * fraction) : share.numel;
  memory.params = 4 * updated;
  memory.grads = 4 * updated;
  memory.optimizer = 8 * updated;
  memory.buffers = predicted ? int64_t(double(predicted->buffers_held) * fraction) : 0;
  if (strategy_shards(*plan.strategy)) {
    memory.buffers += gathered_buffer_bytes(plan, share);
  }
  memory.checkpointing = checkpointing_mode(*plan.config);
  memory.microbatches_held = held;
  memory.activations_none = activation_bytes(plan, share, "none", held);
  memory.activations_selective = activation_bytes(plan, share, "selective", held);
  memory.activations_full = activation_bytes(plan, share, "full", held);
  return memory;
}

// ---- time ----

// Whether the ranks of an `axis` group sit on more than one node: the mesh
// lays axes out (pp, dp_replicate, dp_shard, cp, tp), tp innermost.
bool spans_nodes(const MeshContext& mesh, std::initializer_list<Axis> axes,
                 int64_t ranks_per_node) {
  static constexpr Axis kOrder[] = {Axis::pp, Axis::dp_replicate, Axis::dp_shard, Axis::cp,
                                    Axis::tp};
  int64_t extent = 1;  // stride of the outermost axis of the group x its size
  bool inside = false;
  for (const Axis axis : kOrder) {
    if (std::find(axes.begin(), axes.end(), axis) != axes.end()) inside = true;
    if (inside) extent *= mesh.axis_size(axis);
  }
  return extent > ranks_per_node;
}

double busbw(const HardwareProfile& hw, bool across_nodes) {
  return across_nodes ? hw.inter_node_busbw : hw.intra_node_busbw;
}

struct Communication {
  double data_parallel = 0;       // seconds per step, overlappable with compute
  double data_parallel_edge = 0;  // the part no compute can hide (first gather, last reduce)
  double tensor_parallel = 0;     // exposed
};

Communication estimate_communication(const Plan& plan, const RankShare& share,
                                     const HardwareProfile& hw, int64_t microbatches) {
  const Config& config = *plan.config;
  const MeshContext& mesh = plan.mesh;
  Communication comm;
  const double numel = double(share.numel);
  if (strategy_shards(*plan.strategy)) {
    const double n = double(mesh.axis_size(Axis::dp_shard_cp));
    const double bw = busbw(hw, spans_nodes(mesh, {Axis::dp_shard, Axis::cp}, hw.ranks_per_node));
    const double gathers =
        config.distributed.strategy == "megatron_fsdp" && config.distributed.zero_dp_strategy < 3
            ? 1.0
            : 2.0;
    const double moved =
        (n - 1) / n * numel * (gathers * double(gathered_bytes(config)) + 4.0);  // + reduce-scatter
    comm.data_parallel = moved / bw;
    const double r = double(mesh.axis_size(Axis::dp_replicate));
    if (r > 1) {
      comm.data_parallel += 2 * (r - 1) / r * 4 * numel / n /
                            busbw(hw, spans_nodes(mesh, {Axis::dp_replicate}, hw.ranks_per_node));
    }
    const double units = double(std::max<int64_t>(share.layers, 1));
    comm.data_parallel_edge = comm.data_parallel / units;
  } else {
    const double n = double(mesh.axis_size(Axis::dp_cp));
    const double bw = busbw(
        hw, spans_nodes(mesh, {Axis::dp_replicate, Axis::dp_shard, Axis::cp}, hw.ranks_per_node));
    comm.data_parallel = 2 * (n - 1) / n * 4 * numel / bw;
    const double bucket = std::min(config.distributed.bucket_cap_mb * 1e6, 4 * numel);
    comm.data_parallel_edge = n > 1 ? 2 * (n - 1) / n * bucket / bw : 0;
  }
  const double tp = double(mesh.axis_size(Axis::tp));
  const auto& activations = plan.model->description().activations;
  if (tp > 1 && activations) {
    const int64_t batch = mesh.axis_size(Axis::pp) > 1
                              ? config.distributed.pipeline.pp_microbatch_size
                              : config.train.micro_batch_size;
    const double rows = double(batch * config.data.seq_len) / double(mesh.axis_size(Axis::cp));
    // Two sums of the residual stream per layer forward, two backward.
    const double per_layer = 4 * 2 * (tp - 1) / tp * rows * double(activations->stream) * 4;
    const double exposed = config.distributed.enable_async_tensor_parallel ? 0.5 : 1.0;
    comm.tensor_parallel = exposed * per_layer * double(share.layers) * double(microbatches) /
                           busbw(hw, spans_nodes(mesh, {Axis::tp}, hw.ranks_per_node));
  }
  return comm;
}

// The most one timed GEMM touches: 64 MiB of weights and about 0.25 GFLOP
// (a larger GEMM runs at the rate these sizes reach, and a plan must not
// take minutes); the time is scaled to the whole shape.
constexpr int64_t kTimedWeights = int64_t{1} << 24;
constexpr double kTimedFlops = 2.5e8;

// Seconds of one linear's forward and backward on m rows, k in, n out, on
// this machine's core, timed at a clamped size and scaled; the weight read
// as bfloat16 when `weight_in_bfloat16`.
double timed_linear(const std::string& dtype, bool weight_in_bfloat16, int64_t m, int64_t k,
                    int64_t n, std::map<std::array<int64_t, 3>, double>& timed) {
  const int64_t n_timed = std::max<int64_t>(1, std::min(n, kTimedWeights / k));
  const int64_t m_timed =
      std::max<int64_t>(1, std::min(m, int64_t(kTimedFlops / (2.0 * double(k) * double(n_timed)))));
  const std::array<int64_t, 3> shape{m_timed, k, n_timed};
  if (!timed.contains(shape)) {
    timed[shape] = linear_seconds(dtype, m_timed, k, n_timed, 0.02, weight_in_bfloat16);
  }
  return timed[shape] * double(m) / double(m_timed) * double(n) / double(n_timed);
}

// Seconds of a rank's matmuls in a step. Where the profile times the
// model's GEMMs and the model describes them: each at its tp-local shape on
// its rows of a microbatch, forward and backward, for each microbatch of
// the rank's data-parallel group, its pipeline stage's share; the FLOPs
// they leave (attention's) at the GEMM rate. Otherwise every FLOP at the
// rate. Full checkpointing runs the forward again (4/3).
double matmul_seconds(const Plan& plan, const HardwareProfile& hw, const Estimate& partial,
                      double rate) {
  const Config& config = *plan.config;
  const MeshContext& mesh = plan.mesh;
  const auto& flops = plan.model->description().flops;
  const double recompute = checkpointing_mode(config) == "full" ? 4.0 / 3.0 : 1.0;
  const double all_flops =
      partial.flops_per_token * double(partial.tokens_per_step) / double(mesh.world_size());
  if (!hw.times_model_gemms || !flops || flops->gemms.empty()) return all_flops * recompute / rate;
  const int64_t batch = mesh.axis_size(Axis::pp) > 1
                            ? config.distributed.pipeline.pp_microbatch_size
                            : config.train.micro_batch_size;
  const int64_t rows = batch * config.data.seq_len / mesh.axis_size(Axis::cp);
  const double microbatches =
      double(config.train.global_batch_size) / double(mesh.axis_size(Axis::dp) * batch);
  const int64_t tp = mesh.axis_size(Axis::tp);
  // A strategy gathering in bfloat16 lends the weights as gathered: the
  // GEMMs read them without rounding.
  const bool weight_in_bfloat16 = partial.matmul_dtype == "bfloat16" &&
                                  strategy_shards(*plan.strategy) && gathered_bytes(config) == 2;
  std::map<std::array<int64_t, 3>, double> timed;
  double gemms = 0;
  for (const ModelDescription::Gemm& g : flops->gemms) {
    const int64_t m = std::max<int64_t>(1, std::llround(double(rows) * g.rows));
    gemms += double(g.count) * timed_linear(partial.matmul_dtype, weight_in_bfloat16, m,
                                            g.tp == "k" ? g.k / tp : g.k,
                                            g.tp == "n" ? g.n / tp : g.n, timed);
  }
  gemms *= microbatches / double(mesh.axis_size(Axis::pp)) / hw.core_share;
  const double gemm_flops = 6.0 * double(flops->matmul_parameters) *
                            double(partial.tokens_per_step) / double(mesh.world_size());
  return (gemms + std::max(0.0, all_flops - gemm_flops) / rate) * recompute;
}

TimeEstimate estimate_time(const Plan& plan, const RankShare& share, const HardwareProfile& hw,
                           const Estimate& partial, double bubble_fraction, int64_t updated_numel) {
  const Config& config = *plan.config;
  const MeshContext& mesh = plan.mesh;
  TimeEstimate time;
  const double world = double(mesh.world_size());
  const double rate =
      partial.matmul_dtype == "bfloat16" ? hw.matmul_flops_bfloat16 : hw.matmul_flops_float32;
  time.matmul = matmul_seconds(plan, hw, partial, rate);
  // Element-wise passes: what the forward keeps is written once and read by
  // the backward, and gradients of the same size are written and read.
  const auto& activations = plan.model->description().activations;
  const int64_t pp_microbatch = mesh.axis_size(Axis::pp) > 1
                                    ? config.distributed.pipeline.pp_microbatch_size
                                    : config.train.micro_batch_size;
  const double microbatches =
      double(config.train.global_batch_size) / double(mesh.axis_size(Axis::dp) * pp_microbatch);
  if (activations) {
    const double rank_tokens =
        double(partial.tokens_per_step) / double(mesh.axis_size(Axis::dp_cp));
    const int64_t tp = mesh.axis_size(Axis::tp);
    const bool sp = config.distributed.sequence_parallel;
    const double floats = kept_per_token(*activations, share, "none", tp, sp);
    // A bfloat16 run rounds what it keeps where it is produced (read and
    // write 4 bytes), copies it to bfloat16 (read 4, write 2) and widens it
    // for the backward (read 2, write 4).
    const double converted =
        partial.matmul_dtype == "bfloat16" && activations->float32
            ? 20.0 * bfloat16_kept_per_token(*activations, share, "none", tp, sp)
            : 0.0;
    time.elementwise = (4.0 * 4.0 * floats + converted) * rank_tokens / hw.memory_bandwidth;
  }
  // AdamW reads parameter, gradient and both moments and writes three of
  // them; the gradient norm reads the gradients once more.
  time.optimizer = 8.0 * 4.0 * double(updated_numel) / hw.memory_bandwidth;
  time.compute = time.matmul + time.elementwise + time.optimizer;
  const Communication comm =
      estimate_communication(plan, share, hw, int64_t(std::ceil(microbatches)));
  time.communication = comm.data_parallel + comm.tensor_parallel;
  const double hidden_behind = hw.overlaps_communication ? time.matmul + time.elementwise : 0.0;
  const double data_parallel_exposed =
      std::min(comm.data_parallel,
               std::max(0.0, comm.data_parallel - hidden_behind) + comm.data_parallel_edge);
  time.exposed_communication = data_parallel_exposed + comm.tensor_parallel;
  const double busy = time.compute + time.exposed_communication;
  time.bubble_fraction = bubble_fraction;
  // Ranks sharing cores (core_share < 1) hand the cores they leave idle in
  // the bubble to the others: the step is the longer of the busy time at
  // the shared rate and the critical path at a whole core's.
  time.step =
      std::max(hw.core_share < 1.0 ? busy : 0.0, busy * hw.core_share / (1.0 - bubble_fraction));
  time.bubble = time.step - busy;
  time.tokens_per_s = double(partial.tokens_per_step) / time.step;
  time.mfu = partial.flops_per_token * double(partial.tokens_per_step) / (time.step * world * rate);
  return time;
}

std::string bytes_text(double bytes) {
  return bytes >= kGiB ? fmt::format("{:.2f} GiB", bytes / kGiB)
                       : fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0));
}

std::string optional_bytes(const std::optional<int64_t>& bytes) {
  return bytes ? bytes_text(double(*bytes)) : "not described by the model";
}

std::string seconds_text(double seconds) {
  return seconds >= 1 ? fmt::format("{:.3f} s", seconds) : fmt::format("{:.2f} ms", seconds * 1e3);
}

nlohmann::ordered_json optional_json(const std::optional<int64_t>& value) {
  return value ? nlohmann::ordered_json(*value) : nlohmann::ordered_json(nullptr);
}

}  // namespace

HardwareProfile hardware_profile(const std::string& name, int64_t ranks_per_node) {
  HardwareProfile profile;
  if (name == "h100-sxm") {
    profile = h100_sxm();
  } else if (name == "h200") {
    profile = h200();
  } else if (name == "cpu-this-machine") {
    return cpu_this_machine(ranks_per_node);
  } else if (name.size() > 5 && name.ends_with(".toml")) {
    if (access(name.c_str(), R_OK) != 0) {
      throw Error(MESHRUN_NOT_FOUND, fmt::format("--hardware {}: cannot read the file", name));
    }
    profile = profile_from_file(name);
  } else {
    throw invalid_argument(fmt::format(
        "--hardware {}: expected h100-sxm, h200, cpu-this-machine or a .toml profile file", name));
  }
  if (ranks_per_node > 0) profile.ranks_per_node = ranks_per_node;
  return profile;
}

int64_t MemoryEstimate::total() const {
  const std::optional<int64_t>& held = checkpointing == "full"        ? activations_full
                                       : checkpointing == "selective" ? activations_selective
                                                                      : activations_none;
  return params + grads + optimizer + buffers + held.value_or(0);
}

Estimate estimate_run(const Plan& plan, const HardwareProfile& hardware) {
  if (!plan.model) throw invalid_argument("meshrun plan --estimate: the plan has no model");
  const Config& config = *plan.config;
  Estimate estimate;
  estimate.hardware = hardware;
  const ModelDescription& description = plan.model->description();
  estimate.matmul_dtype = matmul_dtype(config, description);
  estimate.flops_per_token = flops_per_token(description, config.data.seq_len);
  estimate.tokens_per_step = config.train.global_batch_size * config.data.seq_len;
  estimate.nodes = (plan.mesh.world_size() + hardware.ranks_per_node - 1) / hardware.ranks_per_node;

  std::vector<RankShare> shares = rank_shares(plan);
  double bubble = 0;
  std::vector<int64_t> held(shares.size(), 1);
  if (plan.mesh.axis_size(Axis::pp) > 1) {
    const schedule::Simulation simulation = simulate_schedule(plan);
    bubble = simulation.bubble_fraction;
    // A (stage, microbatch) pair held is one stage's share of the rank's.
    const int64_t per_rank = stages_per_rank(plan);
    for (size_t r = 0; r < shares.size(); ++r) {
      held[r] = (simulation.peak_activations[r] + per_rank - 1) / per_rank;
    }
  }
  const std::optional<StrategyMemoryPlan> predicted = predict_state_memory(plan);
  size_t most = 0;
  for (size_t r = 0; r < shares.size(); ++r) {
    const MemoryEstimate memory = estimate_memory(plan, predicted, shares[r], held[r]);
    if (r == 0 || memory.total() > estimate.memory.total()) {
      estimate.memory = memory;
      most = r;
    }
  }
  estimate.time =
      estimate_time(plan, shares[most], hardware, estimate, bubble, estimate.memory.params / 4);
  return estimate;
}

std::string estimate_to_text(const Estimate& e) {
  const MemoryEstimate& m = e.memory;
  const TimeEstimate& t = e.time;
  const HardwareProfile& hw = e.hardware;
  std::string text =
      fmt::format("estimate  on {}: {} node{} of {} ranks; matmuls in {}\n", hw.name, e.nodes,
                  e.nodes == 1 ? "" : "s", hw.ranks_per_node, e.matmul_dtype);
  text += fmt::format("memory    per rank (the rank holding the most): {} of {} ({})\n",
                      bytes_text(double(m.total())), bytes_text(hw.memory_bytes),
                      double(m.total()) <= hw.memory_bytes ? "fits" : "does not fit");
  text += fmt::format("          params {}, grads {}, AdamW moments {}, buffers {}\n",
                      bytes_text(double(m.params)), bytes_text(double(m.grads)),
                      bytes_text(double(m.optimizer)), bytes_text(double(m.buffers)));
  text += fmt::format(
      "          activations ({} microbatch{} held): no checkpointing {}, selective {}, full {};"
      " this plan: {}\n",
      m.microbatches_held, m.microbatches_held == 1 ? "" : "es", optional_bytes(m.activations_none),
      optional_bytes(m.activations_selective), optional_bytes(m.activations_full), m.checkpointing);
  text += fmt::format(
      "step      {}: compute {} (matmuls {}, element-wise {}, optimizer {}), exposed "
      "communication {} of {}, pipeline bubble {} ({:.1f}%)\n",
      seconds_text(t.step), seconds_text(t.compute), seconds_text(t.matmul),
      seconds_text(t.elementwise), seconds_text(t.optimizer), seconds_text(t.exposed_communication),
      seconds_text(t.communication), seconds_text(t.bubble), 100 * t.bubble_fraction);
  text += fmt::format(
      "          {:.0f} tokens/s ({:.0f} per rank), MFU {:.3f} against the GEMM "
      "rate; {:.4g} FLOPs per token, {} tokens per step\n",
      t.tokens_per_s, t.tokens_per_s / double(e.nodes * hw.ranks_per_node), t.mfu,
      e.flops_per_token, e.tokens_per_step);
  return text;
}

nlohmann::ordered_json estimate_to_json(const Estimate& e) {
  const MemoryEstimate& m = e.memory;
  const TimeEstimate& t = e.time;
  const HardwareProfile& hw = e.hardware;
  return {
      {"hardware",
       {{"name", hw.name},
        {"ranks_per_node", hw.ranks_per_node},
        {"matmul_flops_per_s_float32", hw.matmul_flops_float32},
        {"matmul_flops_per_s_bfloat16", hw.matmul_flops_bfloat16},
        {"memory_bandwidth_bytes_per_s", hw.memory_bandwidth},
        {"memory_bytes", hw.memory_bytes},
        {"intra_node_busbw_bytes_per_s", hw.intra_node_busbw},
        {"inter_node_busbw_bytes_per_s", hw.inter_node_busbw}}},
      {"nodes", e.nodes},
      {"matmul_dtype", e.matmul_dtype},
      {"flops_per_token", e.flops_per_token},
      {"tokens_per_step", e.tokens_per_step},
      {"memory",
       {{"params", m.params},
        {"grads", m.grads},
        {"optimizer", m.optimizer},
        {"buffers", m.buffers},
        {"activations",
         {{"none", optional_json(m.activations_none)},
          {"selective", optional_json(m.activations_selective)},
          {"full", optional_json(m.activations_full)}}},
        {"checkpointing", m.checkpointing},
        {"microbatches_held", m.microbatches_held},
        {"total", m.total()},
        {"fits", double(m.total()) <= hw.memory_bytes}}},
      {"time",
       {{"step", t.step},
        {"compute", t.compute},
        {"matmul", t.matmul},
        {"elementwise", t.elementwise},
        {"optimizer", t.optimizer},
        {"communication", t.communication},
        {"exposed_communication", t.exposed_communication},
        {"bubble", t.bubble},
        {"bubble_fraction", t.bubble_fraction},
        {"tokens_per_s", t.tokens_per_s},
        {"mfu", t.mfu}}},
  };
}

}  // namespace meshrun
