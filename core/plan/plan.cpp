#include "plan/plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include "errors.hpp"
#include "strategy/strategy.hpp"
#include "support/input_file.hpp"

namespace meshrun {
namespace {

// Re-throws `error` with the file position of the key it concerns in front.
[[noreturn]] void rethrow_at_key(const Config& config, const Error& error,
                                 const std::string& fallback_key) {
  const std::string key = error.key().empty() ? fallback_key : error.key();
  throw Error(error.code(), config.where(key) + ": " + error.what(), key);
}

// "FILE:LINE:COL: key: what", the one line bad input gets.
[[noreturn]] void fail_at_key(const Config& config, int32_t code, const std::string& key,
                              const std::string& what) {
  throw Error(code, config.where(key) + ": " + key + ": " + what, key);
}

std::shared_ptr<PluginLibrary> load_named(const Config& config, const PluginLoader& loader,
                                          PluginKind kind, const std::string& name,
                                          const std::string& key) {
  try {
    return loader.load(kind, name);
  } catch (const Error& error) {
    fail_at_key(config, error.code(), key, error.what());
  }
}

void check_input_file(const Config& config, const std::string& key, const std::string& path,
                      int64_t max_bytes) {
  if (const auto problem = unreadable_input_file(path, max_bytes)) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, key, *problem);
  }
}

// The files a training run reads whole, checked where `meshrun plan` and
// `meshrun train` both pass, before any rank starts.
void check_input_files(const Config& config) {
  check_input_file(config, "data.path", config.data.path, kMaxDataFileBytes);
  const std::string& csv = config.distributed.pipeline.pp_schedule_csv;
  if (config.distributed.pp_size > 1 && !csv.empty()) {
    check_input_file(config, "distributed.pipeline.pp_schedule_csv", csv, kMaxScheduleCsvBytes);
  }
}

// AutoModel's pp_batch_size is the batch a pipeline step runs: what meshrun
// derives as a data-parallel rank's share of train.global_batch_size. Taken
// when it agrees, refused when it does not, so the key never says one batch
// while the run trains another.
void check_pipeline_batch(const Config& config, const MeshContext& mesh) {
  const std::string key = "distributed.pipeline.pp_batch_size";
  if (mesh.axis_size(Axis::pp) <= 1 || !config.positions.count(key)) return;
  const int64_t batch = config.distributed.pipeline.pp_batch_size;
  const int64_t global = config.train.global_batch_size;
  const int64_t dp = mesh.axis_size(Axis::dp);
  int64_t product = 0;
  if (!__builtin_mul_overflow(batch, dp, &product) && product == global) return;
  const std::string fix = global % dp == 0 ? fmt::format("is {}; set it to {} or remove the key",
                                                         global / dp, global / dp)
                                           : "is not a whole number of sequences; remove the key";
  fail_at_key(config, MESHRUN_INVALID_ARGUMENT, key,
              fmt::format("{} sequences per pipeline step, but meshrun takes the pipeline's batch "
                          "from [train]: a data-parallel rank's share, train.global_batch_size "
                          "({}) / dp ({}), {}",
                          batch, global, dp, fix));
}

// megatron_fsdp_unit_modules names the classes whose modules are units. A
// model computes its own units, its layers: the key may name their class
// (bare or with its module path, as AutoModel writes it) and nothing else.
void check_unit_modules(const Config& config, const Model& model) {
  const std::vector<std::string>& names = config.distributed.megatron_fsdp_unit_modules;
  const std::string& unit_class = model.description().unit_class;
  const auto is_unit_class = [&](const std::string& name) {
    return !unit_class.empty() && name.substr(name.rfind('.') + 1) == unit_class;
  };
  if (std::all_of(names.begin(), names.end(), is_unit_class)) return;
  const std::string fix =
      unit_class.empty()
          ? fmt::format("model plugin {} names no class for its layer units; remove the key",
                        model.library().path())
          : fmt::format("set it to [\"{}\"] or remove the key", unit_class);
  fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.megatron_fsdp_unit_modules",
              fmt::format("megatron_fsdp's units are the model's layers, each gathered and "
                          "reduced as one (its _no_split_modules); units of other modules are "
                          "not implemented: {}",
                          fix));
}

std::shared_ptr<const Model> make_model(const Config& config, const PluginLoader& loader) {
  auto library =
      load_named(config, loader, PluginKind::model, config.model.model_type, "model.model_type");
  try {
    return std::make_shared<const Model>(std::move(library), config.model.architecture);
  } catch (const Error& error) {
    rethrow_at_key(config, error, "model.model_type");
  }
}

MeshFamily mesh_family_of(const PluginLibrary& strategy) {
  const int32_t family = strategy.api().strategy->mesh_family;
  if (family < static_cast<int32_t>(MeshFamily::fsdp2) ||
      family > static_cast<int32_t>(MeshFamily::ddp)) {
    throw Error(
        MESHRUN_INVALID_ARGUMENT,
        fmt::format("strategy plugin {} declares unknown mesh family {}", strategy.path(), family));
  }
  return static_cast<MeshFamily>(family);
}

ParallelismSizes sizes_of(const DistributedConfig& d) {
  const bool zero0 = d.strategy == "megatron_fsdp" && d.zero_dp_strategy == 0;
  return {d.dp_size, d.dp_replicate_size, d.tp_size, d.pp_size, d.cp_size, d.ep_size, zero0};
}

// The product of the named sizes; an overflow is an input error naming the
// largest of them, the one to fix.
int64_t checked_product(const Config& config,
                        std::initializer_list<std::pair<const char*, int64_t>> factors) {
  int64_t product = 1;
  const auto* largest = factors.begin();
  for (const auto* factor = factors.begin(); factor != factors.end(); ++factor) {
    if (factor->second > largest->second) largest = factor;
    if (__builtin_mul_overflow(product, factor->second, &product)) {
      const std::string key = std::string("distributed.") + largest->first;
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  fmt::format("{}: {}: {} makes the number of ranks overflow", config.where(key),
                              key, largest->second),
                  key);
    }
  }
  return product;
}

// Context parallelism is the model's to compute (its description's
// "context_parallel"); it cuts every sequence into 2 cp chunks and Ulysses
// splits each tp rank's heads.
void check_context_parallel(const Config& config, const Model& model) {
  const int64_t cp = config.distributed.cp_size;
  const ContextParallelDegrees degrees = context_parallel_degrees(config);
  if (cp == 1) return;
  const auto& heads = model.description().context_parallel;
  if (!heads) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.cp_size",
                fmt::format("{} > 1, but model plugin {} computes no context parallelism (its "
                            "description has no \"context_parallel\"); set it to 1",
                            cp, model.library().path()));
  }
  if (config.data.seq_len % (2 * cp) != 0) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "data.seq_len",
                fmt::format("{} is not divisible by 2 x distributed.cp_size ({}): context "
                            "parallelism cuts each sequence into 2 cp equal chunks (rank i keeps "
                            "chunks i and 2 cp - 1 - i, which balances causal attention)",
                            config.data.seq_len, 2 * cp));
  }
  const int64_t tp = config.distributed.tp_size;
  const int64_t local_heads = heads->heads / tp, local_kv_heads = heads->kv_heads / tp;
  if (local_heads % degrees.ulysses != 0 || local_kv_heads % degrees.ulysses != 0) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.cp_ulysses_degree",
                fmt::format("{} does not divide the {} attention heads and {} key/value heads "
                            "each tp rank computes ({} and {} over tp_size {}): Ulysses gives "
                            "each of its ranks whole heads",
                            degrees.ulysses, local_heads, local_kv_heads, heads->heads,
                            heads->kv_heads, tp));
  }
}

// A CUDA run needs a model that computes on CUDA (its description's
// "devices"); whether this machine has a GPU is the launch's to check.
void check_model_device(const Config& config, const Model& model) {
  if (!config.dist_env.on_cuda()) return;
  const std::vector<std::string>& devices = model.description().devices;
  if (std::find(devices.begin(), devices.end(), "cuda") != devices.end()) return;
  fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "dist_env.backend",
              fmt::format("\"nccl\" puts every rank on a CUDA GPU, and model plugin {} computes "
                          "on the CPU only (its description's \"devices\" are [\"{}\"]); set it "
                          "to \"gloo\" or \"mpi\"",
                          model.library().path(), fmt::join(devices, "\", \"")));
}

// Tensor parallelism is the model's to compute: a description saying
// "tensor_parallel": false refuses it before a rank starts.
void check_model_tensor_parallel(const Config& config, const Model& model) {
  const int64_t tp = config.distributed.tp_size;
  if (tp == 1 || model.description().tensor_parallel) return;
  fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.tp_size",
              fmt::format("{} > 1, but model plugin {} computes no tensor parallelism (its "
                          "description says \"tensor_parallel\": false); set it to 1",
                          tp, model.library().path()));
}

// Expert parallelism spreads a mixture of experts' experts (its
// description's "experts") evenly over the ep ranks of a pipeline stage.
void check_expert_parallel(const Config& config, const Model& model) {
  const DistributedConfig& d = config.distributed;
  if (d.ep_size == 1) return;
  const auto& experts = model.description().experts;
  if (!experts) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.ep_size",
                fmt::format("{} > 1, but model plugin {} has no experts (its description has no "
                            "\"experts\"); set it to 1, or train a mixture of experts "
                            "(model_type \"mixtral\")",
                            d.ep_size, model.library().path()));
  }
  if (experts->count % d.ep_size != 0) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, "distributed.ep_size",
                fmt::format("{} does not divide the model's {} experts per layer: each ep rank "
                            "holds the same number of whole experts",
                            d.ep_size, experts->count));
  }
  const auto refuse_with = [&](const char* key, int64_t value, const char* why) {
    if (value == 1) return;
    fail_at_key(
        config, MESHRUN_INVALID_ARGUMENT, key,
        fmt::format("{} > 1 with distributed.ep_size {}: {}; set it to 1", value, d.ep_size, why));
  };
  refuse_with("distributed.tp_size", d.tp_size,
              "the experts' ranks would then hold the same tokens twice; expert parallelism "
              "runs over data-parallel ranks only");
}

}  // namespace

ContextParallelDegrees context_parallel_degrees(const Config& config) {
  const DistributedConfig& d = config.distributed;
  const int64_t cp = d.cp_size;
  const int64_t ring = d.cp_ring_degree, ulysses = d.cp_ulysses_degree;
  const auto refuse = [&](const char* key, int64_t value) {
    fail_at_key(config, MESHRUN_INVALID_ARGUMENT, key,
                fmt::format("{} does not fit distributed.cp_size ({}): cp_ring_degree x "
                            "cp_ulysses_degree must be cp_size (either may be left out: it is "
                            "then cp_size / the other)",
                            value, cp));
  };
  if (ring > 0 && ulysses > 0 && ring * ulysses != cp)
    refuse("distributed.cp_ulysses_degree", ulysses);
  if (ring > 0 && cp % ring != 0) refuse("distributed.cp_ring_degree", ring);
  if (ulysses > 0 && cp % ulysses != 0) refuse("distributed.cp_ulysses_degree", ulysses);
  if (ring > 0) return {ring, cp / ring};
  if (ulysses > 0) return {cp / ulysses, ulysses};
  return {cp, 1};
}

std::shared_ptr<PluginLibrary> load_strategy(const Config& config, const PluginLoader& loader) {
  return load_named(config, loader, PluginKind::strategy, config.distributed.strategy,
                    "distributed.strategy");
}

MeshContext resolve_config_mesh(const Config& config, int64_t world_size,
                                const PluginLibrary& strategy) {
  try {
    return resolve_mesh(sizes_of(config.distributed), world_size, mesh_family_of(strategy));
  } catch (const Error& error) {
    rethrow_at_key(config, error, "distributed");
  }
}

Plan make_plan(const Config& config, int64_t world_size, const PluginLoader& loader,
               bool with_model) {
  Plan plan;
  plan.config = &config;
  plan.strategy = load_strategy(config, loader);
  plan.mesh = resolve_config_mesh(config, world_size, *plan.strategy);
  if (!with_model) return plan;
  check_input_files(config);
  check_pipeline_batch(config, plan.mesh);
  plan.model = make_model(config, loader);
  check_unit_modules(config, *plan.model);
  check_context_parallel(config, *plan.model);
  check_expert_parallel(config, *plan.model);
  check_model_tensor_parallel(config, *plan.model);
  check_model_device(config, *plan.model);
  if (loader.find(PluginKind::sidecar, config.model.model_type)) {
    plan.sidecar = load_named(config, loader, PluginKind::sidecar, config.model.model_type,
                              "model.model_type");
  }
  const auto& pipeline = config.distributed.pipeline;
  if (config.distributed.pp_size > 1 && pipeline.pp_schedule_csv.empty()) {
    plan.schedule = load_named(config, loader, PluginKind::schedule, pipeline.pp_schedule,
                               "distributed.pipeline.pp_schedule");
  }
  try {
    plan.model_plan = plan_model(config, plan.mesh, *plan.model, plan.sidecar, plan.schedule.get());
    plan.tensor_parallel = std::make_shared<const TensorParallelLayout>(
        plan.model->description(), plan.model_plan, plan.mesh.axis_size(Axis::tp));
  } catch (const Error& error) {
    rethrow_at_key(config, error, "model.model_type");
  }
  return plan;
}

int64_t default_world_size(const Config& config) {
  const auto sizes = sizes_of(config.distributed);
  // The world returned below is at most this product (the 2 is dp's room
  // above dp_replicate), so checking it once keeps the arithmetic exact.
  checked_product(config, {{"tp_size", sizes.tp_size},
                           {"cp_size", sizes.cp_size},
                           {"pp_size", sizes.pp_size},
                           {"dp_size", std::max<int64_t>(1, sizes.dp_size)},
                           {"dp_replicate_size", sizes.dp_replicate_size},
                           {"dp_replicate_size", 2},
                           {"ep_size", sizes.ep_size}});
  const int64_t model_parallel = sizes.tp_size * sizes.cp_size * sizes.pp_size;
  if (sizes.dp_size > 0) return sizes.dp_size * model_parallel;
  // The smallest dp that is a multiple of dp_replicate (and larger than it
  // unless it is 1) and makes dp * cp * tp a multiple of ep.
  const int64_t replicate = sizes.dp_replicate_size;
  const int64_t for_ep = sizes.ep_size / std::gcd(sizes.ep_size, sizes.cp_size * sizes.tp_size);
  int64_t dp = std::lcm(replicate, for_ep);
  if (replicate != 1 && dp == replicate) dp *= 2;
  return dp * model_parallel;
}

namespace {

nlohmann::ordered_json plugin_json(const PluginLibrary& library) {
  const auto& api = library.api();
  return {{"name", api.name},
          {"file", library.path()},
          {"abi", fmt::format("{}.{}", api.abi_major, api.abi_minor)},
          {"version", api.version}};
}

nlohmann::ordered_json plugin_json(const std::shared_ptr<PluginLibrary>& library) {
  return library ? plugin_json(*library) : nlohmann::ordered_json(nullptr);
}

std::vector<Axis> listed_axes(const MeshContext& mesh) {
  std::vector<Axis> axes(kMeshAxes.begin(), kMeshAxes.end());
  axes.insert(axes.end(), kFlattenedAxes.begin(), kFlattenedAxes.end());
  if (mesh.has_moe()) axes.insert(axes.end(), kMoeAxes.begin(), kMoeAxes.end());
  return axes;
}

template <class Range>
nlohmann::ordered_json sizes_json(const MeshContext& mesh, const Range& axes) {
  nlohmann::ordered_json object = nlohmann::ordered_json::object();
  for (Axis axis : axes) object[std::string(axis_name(axis))] = mesh.axis_size(axis);
  return object;
}

constexpr int64_t kJsonRankLimit = 4096;
constexpr int64_t kTextRankEdge = 8;

// The strategy's layout of the tp-local parameters of a one-stage run:
// description order, the units as the stage's hooks number them.
std::pair<StrategyBuffers, StrategyUnits> strategy_layout(const ModelDescription& local) {
  StrategyBuffers layout{nullptr, nullptr, local.numel, {0}, {}};
  std::vector<int32_t> all(local.units.size());
  for (size_t u = 0; u < all.size(); ++u) all[u] = int32_t(u);
  const StrategyUnitNumbers numbers = strategy_unit_numbers(local, all);
  StrategyUnits units{nullptr, nullptr, numbers.num_units, numbers.root_unit, {}, {}};
  for (const ModelParameter& parameter : local.parameters) {
    layout.parameter_offsets.push_back(parameter.offset + parameter.numel);
    layout.parameter_names.push_back(parameter.name);
    units.parameter_units.push_back(numbers.of_model_unit[size_t(parameter.unit)]);
    units.parameter_rows.push_back(parameter.shape.empty() ? 1 : parameter.shape.front());
  }
  return {std::move(layout), std::move(units)};
}

// What a rank holds between steps for the parameters it updates, as the
// strategy predicts it (plan_memory): float32 values and gradients and
// AdamW's two float32 moments, 16 bytes an element, and the buffers the
// strategy holds from setup. Units gathered during a step and
// communication buffers come on top. Null without a model, with a
// pipeline (each rank holds its stages), and for a sharded strategy that
// predicts nothing.
nlohmann::ordered_json state_memory(const Plan& plan) {
  if (!plan.model || plan.mesh.axis_size(Axis::pp) > 1) return nullptr;
  const std::optional<StrategyMemoryPlan> predicted = predict_state_memory(plan);
  if (!predicted) return nullptr;
  const int64_t ranks =
      strategy_shards(*plan.strategy) ? plan.mesh.axis_size(Axis::dp_shard_cp) : 1;
  const int64_t elements = predicted->local_numel;
  return {{"sharded_over", ranks},
          {"params", 4 * elements},
          {"grads", 4 * elements},
          {"optimizer", 8 * elements},
          {"buffers_held", predicted->buffers_held}};
}

}  // namespace

int64_t pipeline_microbatches(const Config& config, int64_t dp) {
  return config.train.global_batch_size / dp / config.distributed.pipeline.pp_microbatch_size;
}

std::optional<StrategyMemoryPlan> predict_state_memory(const Plan& plan) {
  const auto [layout, units] = strategy_layout(plan.tensor_parallel->local());
  const int64_t ranks =
      strategy_shards(*plan.strategy) ? plan.mesh.axis_size(Axis::dp_shard_cp) : 1;
  return plan_strategy_memory(plan.strategy, layout, units, ranks,
                              plan.mesh.axis_size(Axis::dp_replicate),
                              strategy_options_json(plan.config->distributed));
}

namespace {

// Ranks a node: `ranks_per_node`, or the whole world on one node.
int64_t node_size(const Plan& plan, int64_t ranks_per_node) {
  return ranks_per_node > 0 ? ranks_per_node : plan.mesh.world_size();
}

}  // namespace

std::string rank_device(const Plan& plan, int64_t rank, int64_t ranks_per_node) {
  if (!plan.config->dist_env.on_cuda()) return "cpu";
  return fmt::format("cuda:{}", rank % node_size(plan, ranks_per_node));
}

nlohmann::ordered_json plan_to_json(const Plan& plan, bool all_ranks, int64_t ranks_per_node) {
  const MeshContext& mesh = plan.mesh;
  const Config& config = *plan.config;
  nlohmann::ordered_json json = {
      {"world_size", mesh.world_size()},
      {"strategy", config.distributed.strategy},
      {"device", config.dist_env.on_cuda() ? "cuda" : "cpu"},
      {"mesh_family", std::string(mesh_family_name(mesh.family()))},
      {"axes", sizes_json(mesh, kMeshAxes)},
      {"flattened", sizes_json(mesh, kFlattenedAxes)},
      {"moe", mesh.has_moe() ? sizes_json(mesh, kMoeAxes) : nlohmann::ordered_json(nullptr)},
      {"plugins",
       {{"strategy", plugin_json(plan.strategy)},
        {"model",
         plan.model ? plugin_json(plan.model->library()) : nlohmann::ordered_json(nullptr)},
        {"sidecar", plugin_json(plan.sidecar)},
        {"schedule", plugin_json(plan.schedule)}}},
      {"warnings", config.warnings},
      {"model", plan.model_plan},
      {"memory", state_memory(plan)},
  };
  if (!all_ranks && mesh.world_size() > kJsonRankLimit) return json;
  const auto axes = listed_axes(mesh);
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (int64_t rank = 0; rank < mesh.world_size(); ++rank) {
    nlohmann::ordered_json coords = nlohmann::ordered_json::object();
    for (Axis axis : axes) coords[std::string(axis_name(axis))] = mesh.coordinate(rank, axis);
    nlohmann::ordered_json entry = {{"rank", rank}, {"coords", std::move(coords)}};
    if (config.dist_env.on_cuda()) {
      entry["node"] = rank / node_size(plan, ranks_per_node);
      entry["device"] = rank_device(plan, rank, ranks_per_node);
    }
    ranks.push_back(std::move(entry));
  }
  json["ranks"] = std::move(ranks);
  return json;
}

namespace {

std::string plugin_line(std::string_view role, const PluginLibrary& library) {
  const auto& api = library.api();
  return fmt::format("{:<10}{:<24}ABI {}.{}  {}\n", role, api.name, api.abi_major, api.abi_minor,
                     library.path());
}

std::string sidecar_line(const Plan& plan) {
  if (plan.sidecar) return plugin_line("sidecar", *plan.sidecar);
  return fmt::format("{:<10}none for model_type {} (the default plan)\n", "sidecar",
                     plan.config->model.model_type);
}

std::string schedule_line(const Plan& plan) {
  const auto& d = plan.config->distributed;
  if (plan.schedule) return plugin_line("schedule", *plan.schedule);
  if (d.pp_size > 1) return fmt::format("{:<10}CSV {}\n", "schedule", d.pipeline.pp_schedule_csv);
  return fmt::format("{:<10}none (pp_size 1: no pipeline)\n", "schedule");
}

std::string axes_line(const MeshContext& mesh, std::string_view title, const auto& axes) {
  std::string names, sizes;
  for (Axis axis : axes) {
    names += fmt::format("{}{}", names.empty() ? "" : ", ", axis_name(axis));
    sizes += fmt::format("{}{}", sizes.empty() ? "" : ", ", mesh.axis_size(axis));
  }
  return fmt::format("{:<10}({}) = ({})\n", title, names, sizes);
}

// The ranks' coordinates, and in a CUDA run each one's node and GPU.
std::string rank_table(const Plan& plan, bool all_ranks, int64_t ranks_per_node) {
  const MeshContext& mesh = plan.mesh;
  const bool cuda = plan.config->dist_env.on_cuda();
  const auto axes = listed_axes(mesh);
  std::string table = fmt::format("{:>8}", "rank");
  for (Axis axis : axes) table += fmt::format(" {:>12}", axis_name(axis));
  if (cuda) table += fmt::format(" {:>8} {:>8}", "node", "device");
  table += "\n";
  const int64_t world = mesh.world_size();
  const bool collapse = !all_ranks && world > 2 * kTextRankEdge;
  for (int64_t rank = 0; rank < world; ++rank) {
    if (collapse && rank == kTextRankEdge) {
      table += fmt::format("{:>8} ({} ranks not shown; --all-ranks lists them)\n", "...",
                           world - 2 * kTextRankEdge);
      rank = world - kTextRankEdge;
    }
    table += fmt::format("{:>8}", rank);
    for (Axis axis : axes) table += fmt::format(" {:>12}", mesh.coordinate(rank, axis));
    if (cuda) {
      table += fmt::format(" {:>8} {:>8}", rank / node_size(plan, ranks_per_node),
                           rank_device(plan, rank, ranks_per_node));
    }
    table += "\n";
  }
  return table;
}

// A field of a rule or stage a sidecar wrote, as text, whatever its type.
std::string shown(const nlohmann::ordered_json& object, const char* name) {
  if (!object.is_object() || !object.contains(name)) return "?";
  const auto& value = object.at(name);
  return value.is_string() ? value.get<std::string>() : value.dump();
}

// The plan's tp rules, stages and checkpointing; the plan check has made
// sure the arrays are there.
std::string model_lines(const ModelDescription& description, const nlohmann::ordered_json& model) {
  int64_t layers = 0;
  for (int32_t u = 0; u < description.root_unit(); ++u) layers += description.is_layer_unit(u);
  const int64_t others = int64_t(description.units.size()) - 1 - layers;
  std::string text = fmt::format(
      "{:<10}{} parameters in {} tensors, {} sharding units (root, {} layers{})\n", "model",
      description.numel, description.parameters.size(), description.units.size(), layers,
      others > 0 ? fmt::format(", {} for the embedding and the head", others) : "");
  for (const auto& rule : model.at("tensor_parallel")) {
    text += fmt::format("{:<10}{:<40}{:<18}{}\n", "tp", shown(rule, "module"), shown(rule, "style"),
                        shown(rule, "activations"));
  }
  std::map<std::string, int64_t> tensors;
  int64_t local_numel = 0;
  for (const auto& parameter : model.at("parameters")) {
    ++tensors[shown(parameter, "tp")];
    int64_t numel = 1;
    for (const auto& extent : parameter.value("local_shape", nlohmann::ordered_json::array())) {
      numel *= extent.is_number_integer() ? extent.get<int64_t>() : 0;
    }
    local_numel += numel;
  }
  if (local_numel != description.numel) {
    std::string counts;
    for (const auto& [placement, count] : tensors) {
      counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", placement, count);
    }
    text += fmt::format("{:<10}tensors placed {}; {} parameters per tp rank\n", "tp", counts,
                        local_numel);
  }
  const auto pipeline = model.value("pipeline", nlohmann::ordered_json());
  for (const auto& stage : pipeline.is_array() ? pipeline : nlohmann::ordered_json::array()) {
    std::string modules;
    for (const auto& module : stage.at("modules")) {
      modules += (modules.empty() ? "" : ", ") + module.get<std::string>();
    }
    text += fmt::format("{:<10}{} on rank {}: {}\n", "stage", shown(stage, "stage"),
                        shown(stage, "rank"), modules);
  }
  const auto& checkpointed = model.at("activation_checkpointing");
  if (!checkpointed.empty()) {
    text += fmt::format("{:<10}{} of {} layer units\n", "ac", shown(checkpointed[0], "mode"),
                        checkpointed.size());
  }
  const auto autocast = model.value("autocast_dtype", nlohmann::ordered_json());
  if (autocast.is_string()) {
    text += fmt::format("{:<10}matmuls in {} (operands in {}, float32 sums)\n", "compute",
                        autocast.get<std::string>(), autocast.get<std::string>());
  }
  const auto cp = model.value("context_parallel", nlohmann::ordered_json());
  if (cp.is_object()) {
    text += fmt::format(
        "{:<10}each sequence in {} chunks over {} ranks (rank i: chunks i and "
        "{}-i); attention by ring {} x Ulysses {}\n",
        "context", shown(cp, "chunks"), shown(cp, "size"), cp.at("chunks").get<int64_t>() - 1,
        shown(cp, "ring_degree"), shown(cp, "ulysses_degree"));
  }
  return text;
}

std::string memory_line(const Plan& plan) {
  const nlohmann::ordered_json memory = state_memory(plan);
  if (memory.is_null()) return "";
  const int64_t ranks = memory.at("sharded_over").get<int64_t>();
  const int64_t params = memory.at("params").get<int64_t>();
  const int64_t grads = memory.at("grads").get<int64_t>();
  const int64_t optimizer = memory.at("optimizer").get<int64_t>();
  const int64_t held = memory.at("buffers_held").get<int64_t>();
  const std::string where =
      ranks == 1 ? "replicated" : fmt::format("sharded over dp_shard_cp ({})", ranks);
  const std::string buffers =
      held > 0 ? fmt::format(" + buffers held from setup {} B", held) : std::string();
  return fmt::format(
      "{:<10}per rank {} B: params {} B + grads {} B + AdamW moments {} B{}, float32, {}; "
      "units gathered in a step and comm buffers come on top\n",
      "memory", params + grads + optimizer + held, params, grads, optimizer, buffers, where);
}

}  // namespace

namespace {

// Where the ranks compute: "cpu", or each local rank's GPU.
std::string device_line(const Plan& plan, int64_t ranks_per_node) {
  const Config& config = *plan.config;
  const std::string why = fmt::format("(dist_env.backend \"{}\")", config.dist_env.backend);
  if (!config.dist_env.on_cuda()) return fmt::format("{:<10}cpu, every rank {}\n", "device", why);
  const int64_t node = node_size(plan, ranks_per_node);
  return fmt::format(
      "{:<10}cuda: a GPU per local rank, {} rank{} a node ({}), rank r on GPU r % {} "
      "of node r / {} {}\n",
      "device", node, node == 1 ? "" : "s", ranks_per_node > 0 ? "--nproc-per-node" : "one node",
      node, node, why);
}

}  // namespace

std::string plan_to_text(const Plan& plan, bool all_ranks, int64_t ranks_per_node) {
  const MeshContext& mesh = plan.mesh;
  std::string text = fmt::format(
      "meshrun plan: {}, world size {}, strategy {} ({} mesh)\n", plan.config->source,
      mesh.world_size(), plan.config->distributed.strategy, mesh_family_name(mesh.family()));
  for (const auto& warning : plan.config->warnings) text += "warning: " + warning + "\n";
  text += plugin_line("strategy", *plan.strategy);
  if (plan.model) {
    text += plugin_line("model", plan.model->library());
    text += sidecar_line(plan);
    text += schedule_line(plan);
    text += model_lines(plan.model->description(), plan.model_plan);
    text += memory_line(plan);
  }
  text += device_line(plan, ranks_per_node);
  text += axes_line(mesh, "mesh", kMeshAxes);
  text += axes_line(mesh, "flattened", kFlattenedAxes);
  text += mesh.has_moe() ? axes_line(mesh, "moe", kMoeAxes)
                         : fmt::format("{:<10}none (ep_size 1)\n", "moe");
  return text + rank_table(plan, all_ranks, ranks_per_node);
}

}  // namespace meshrun
