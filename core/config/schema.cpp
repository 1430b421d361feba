// The tables of the config and their keys, one entry per key. The names are
// Hugging Face config.json's ([model]) and NeMo AutoModel's ([distributed]).
#include "config/schema.hpp"

namespace meshrun::config_detail {
namespace {

const std::vector<std::string> kParameterDtypes = {"float32", "bfloat16"};
const std::vector<std::string> kComputeDtypes = {"float32", "bfloat16", "float16"};

void read_betas(const Entry& entry, Config& config) {
  const std::string expected = "an array of 2 numbers in [0, 1) ([beta1, beta2])";
  const auto* array = entry.node->as_array();
  if (array == nullptr || array->size() != 2) fail_type(entry, expected);
  double betas[2];
  for (size_t i = 0; i < 2; ++i) {
    const toml::node& element = *array->get(i);
    const std::optional<double> value = number_value(element);
    if (!value || !kFraction.contains(*value)) fail_type(entry, expected);
    betas[i] = *value;
  }
  config.train.beta1 = betas[0];
  config.train.beta2 = betas[1];
}

void read_strategy(const Entry& entry, Config& config) {
  config.distributed.strategy = canonical_strategy_name(read_name(entry, /*allow_dash=*/true));
}

void read_dp_size(const Entry& entry, Config& config) {
  const int64_t dp_size = read_integer(entry, std::numeric_limits<int64_t>::min());
  if (dp_size < 0) {
    fail(entry,
         "expected an integer >= 0 (0 or absent: world size / (tp_size * cp_size * "
         "pp_size)), got " +
             std::to_string(dp_size));
  }
  config.distributed.dp_size = dp_size;
}

// AutoModel accepts false, true (meaning "full") or a mode name.
void read_activation_checkpointing(const Entry& entry, Config& config) {
  if (const auto* flag = entry.node->as_boolean()) {
    config.distributed.activation_checkpointing = flag->get() ? "full" : "";
    return;
  }
  if (!entry.node->is_string()) fail_type(entry, "false, true, 'full' or 'selective'");
  config.distributed.activation_checkpointing = read_choice(entry, {"full", "selective"});
}

// The strings of `node`, an array of strings; fails naming `expected` otherwise.
std::vector<std::string> read_strings(const Entry& entry, const toml::node& node,
                                      const std::string& expected) {
  const auto* names = node.as_array();
  if (names == nullptr || !names->is_homogeneous(toml::node_type::string)) {
    fail_type(entry, expected);
  }
  std::vector<std::string> strings;
  for (const toml::node& name : *names) strings.push_back(name.as_string()->get());
  return strings;
}

void read_module_fqns(const Entry& entry, Config& config) {
  const std::string expected = "an array of arrays of strings (module names per model part)";
  const auto* parts = entry.node->as_array();
  if (parts == nullptr) fail_type(entry, expected);
  std::vector<std::vector<std::string>> result;
  for (const toml::node& part : *parts) result.push_back(read_strings(entry, part, expected));
  config.distributed.pipeline.module_fqns_per_model_part = std::move(result);
}

void read_unit_modules(const Entry& entry, Config& config) {
  config.distributed.megatron_fsdp_unit_modules =
      read_strings(entry, *entry.node, "an array of strings (module class names)");
}

std::vector<Field> model_fields() {
  return TableBuilder<ModelConfig>([](Config& c) -> ModelConfig& { return c.model; })
      .name("model_type", &ModelConfig::model_type)
      .choice("torch_dtype", &ModelConfig::torch_dtype, kParameterDtypes)
      .string("checkpoint", &ModelConfig::checkpoint)
      .build();
}

// An architecture key: kept as JSON for the model plugin, which checks it.
void read_architecture_key(const Entry& entry, Config& config) {
  const std::string name = entry.key.substr(entry.key.find('.') + 1);
  config.model.architecture[name] = to_json(*entry.node);
}

std::vector<Field> data_fields() {
  return TableBuilder<DataConfig>([](Config& c) -> DataConfig& { return c.data; })
      .path("path", &DataConfig::path)
      .number("val_fraction", &DataConfig::val_fraction, kFraction)
      .integer("seq_len", &DataConfig::seq_len, 1)
      .build();
}

std::vector<Field> train_fields() {
  return TableBuilder<TrainConfig>([](Config& c) -> TrainConfig& { return c.train; })
      .integer("steps", &TrainConfig::steps, 1)
      .integer("global_batch_size", &TrainConfig::global_batch_size, 1)
      .integer("micro_batch_size", &TrainConfig::micro_batch_size, 1)
      .number("lr", &TrainConfig::lr, kPositive)
      .number("min_lr", &TrainConfig::min_lr, kNonNegative)
      .integer("warmup_steps", &TrainConfig::warmup_steps, 0)
      .custom("betas", read_betas)
      .number("eps", &TrainConfig::eps, kPositive)
      .number("weight_decay", &TrainConfig::weight_decay, kNonNegative)
      .number("max_grad_norm", &TrainConfig::max_grad_norm, kNonNegative)
      .integer("seed", &TrainConfig::seed, 0)
      .integer("val_every", &TrainConfig::val_every, 0)
      .integer("log_every", &TrainConfig::log_every, 1)
      .integer("skip_nonfinite_steps", &TrainConfig::skip_nonfinite_steps, 0)
      .boolean("profile", &TrainConfig::profile)
      .build();
}

std::vector<Field> checkpoint_fields() {
  return TableBuilder<CheckpointConfig>([](Config& c) -> CheckpointConfig& { return c.checkpoint; })
      .integer("save_every", &CheckpointConfig::save_every, 0)
      .string("resume_from", &CheckpointConfig::resume_from)
      .boolean("export", &CheckpointConfig::export_consolidated)
      .build();
}

std::vector<Field> comm_fields() {
  return TableBuilder<CommConfig>([](Config& c) -> CommConfig& { return c.comm; })
      .name("backend", &CommConfig::backend)
      .number("timeout_minutes", &CommConfig::timeout_minutes, kPositive)
      .build();
}

std::vector<Field> dist_env_fields() {
  return TableBuilder<DistEnvConfig>([](Config& c) -> DistEnvConfig& { return c.dist_env; })
      .choice("backend", &DistEnvConfig::backend, {"nccl", "gloo", "mpi"})
      .build();
}

std::vector<Field> pipeline_fields() {
  using P = PipelineConfig;
  return TableBuilder<P>([](Config& c) -> P& { return c.distributed.pipeline; })
      .name("pp_schedule", &P::pp_schedule)
      .string("pp_schedule_csv", &P::pp_schedule_csv)
      .integer("pp_microbatch_size", &P::pp_microbatch_size, 1)
      .integer("pp_batch_size", &P::pp_batch_size, 1)
      .integer("layers_per_stage", &P::layers_per_stage, 1)
      .choice("round_virtual_stages_to_pp_multiple", &P::round_virtual_stages_to_pp_multiple,
              {"up", "down"})
      .custom("module_fqns_per_model_part", read_module_fqns)
      .boolean("scale_grads_in_schedule", &P::scale_grads_in_schedule)
      .integer("pp_seq_len", &P::pp_seq_len, 0)
      .boolean("pp_recv_buffer_pool", &P::pp_recv_buffer_pool)
      .build();
}

std::vector<Field> moe_fields() {
  return TableBuilder<MoeConfig>([](Config& c) -> MoeConfig& { return c.distributed.moe; })
      .boolean("ignore_router_for_ac", &MoeConfig::ignore_router_for_ac)
      .boolean("reshard_after_forward", &MoeConfig::reshard_after_forward)
      .choice("lm_head_precision", &MoeConfig::lm_head_precision, kComputeDtypes)
      .boolean("wrap_outer_model", &MoeConfig::wrap_outer_model)
      .build();
}

std::vector<Field> mp_policy_fields() {
  using M = MixedPrecisionConfig;
  return TableBuilder<M>([](Config& c) -> M& { return c.distributed.mp_policy; })
      .choice("param_dtype", &M::param_dtype, kComputeDtypes)
      .choice("reduce_dtype", &M::reduce_dtype, kComputeDtypes)
      .choice("output_dtype", &M::output_dtype, kComputeDtypes)
      .boolean("cast_forward_inputs", &M::cast_forward_inputs)
      .build();
}

std::vector<Field> distributed_fields(const TableSchema& pipeline, const TableSchema& moe,
                                      const TableSchema& mp_policy) {
  using D = DistributedConfig;
  return TableBuilder<D>([](Config& c) -> D& { return c.distributed; })
      .custom("strategy", read_strategy)
      .custom("dp_size", read_dp_size)
      .integer("dp_replicate_size", &D::dp_replicate_size, 1)
      .integer("tp_size", &D::tp_size, 1)
      .integer("pp_size", &D::pp_size, 1)
      .integer("cp_size", &D::cp_size, 1)
      .integer("cp_ring_degree", &D::cp_ring_degree, 0)
      .integer("cp_ulysses_degree", &D::cp_ulysses_degree, 0)
      .integer("ep_size", &D::ep_size, 1)
      .boolean("sequence_parallel", &D::sequence_parallel)
      .custom("activation_checkpointing", read_activation_checkpointing)
      .name("activation_checkpointing_scope", &D::activation_checkpointing_scope)
      .choice("autocast_dtype", &D::autocast_dtype, kComputeDtypes)
      .table("pipeline", pipeline)
      .table("moe", moe)
      .owned_by("ddp")
      .boolean("broadcast_buffers", &D::broadcast_buffers)
      .boolean("find_unused_parameters", &D::find_unused_parameters)
      .boolean("static_graph", &D::static_graph)
      .number("bucket_cap_mb", &D::bucket_cap_mb, kPositive)
      .boolean("gradient_as_bucket_view", &D::gradient_as_bucket_view)
      .owned_by("fsdp2")
      .string("tp_plan", &D::tp_plan)
      .string("offload_policy", &D::offload_policy)
      .boolean("defer_fsdp_grad_sync", &D::defer_fsdp_grad_sync)
      .optional_boolean("reshard_after_forward", &D::reshard_after_forward)
      .boolean("enable_async_tensor_parallel", &D::enable_async_tensor_parallel)
      .boolean("enable_compile", &D::enable_compile)
      .boolean("enable_fsdp2_prefetch", &D::enable_fsdp2_prefetch)
      .integer("fsdp2_forward_prefetch_depth", &D::fsdp2_forward_prefetch_depth, 0)
      .integer("fsdp2_backward_prefetch_depth", &D::fsdp2_backward_prefetch_depth, 0)
      .table("mp_policy", mp_policy)
      .owned_by("megatron_fsdp")
      .integer("zero_dp_strategy", &D::zero_dp_strategy, 0, 3)
      .boolean("overlap_grad_reduce", &D::overlap_grad_reduce)
      .boolean("overlap_param_gather", &D::overlap_param_gather)
      .boolean("grad_reduce_in_fp32", &D::grad_reduce_in_fp32)
      .boolean("preserve_fp32_weights", &D::preserve_fp32_weights)
      .boolean("fsdp_double_buffer", &D::fsdp_double_buffer)
      .boolean("disable_bucketing", &D::disable_bucketing)
      .boolean("average_in_collective", &D::average_in_collective)
      .boolean("report_nan_in_param_grad", &D::report_nan_in_param_grad)
      .boolean("check_for_nan_in_grad", &D::check_for_nan_in_grad)
      .boolean("calculate_per_token_loss", &D::calculate_per_token_loss)
      .boolean("init_fsdp_with_meta_device", &D::init_fsdp_with_meta_device)
      .boolean("nccl_ub", &D::nccl_ub)
      .boolean("keep_fp8_transpose_cache", &D::keep_fp8_transpose_cache)
      .custom("megatron_fsdp_unit_modules", read_unit_modules)
      .build();
}

Field table_field(std::string name, const TableSchema& schema) {
  return Field{std::move(name), nullptr, &schema, {}};
}

}  // namespace

const TableSchema& root_schema() {
  static const TableSchema model{"model", nullptr, model_fields(), read_architecture_key};
  static const TableSchema data{"data", nullptr, data_fields(), {}};
  static const TableSchema train{"train", nullptr, train_fields(), {}};
  static const TableSchema checkpoint{"checkpoint", nullptr, checkpoint_fields(), {}};
  static const TableSchema dist_env{"dist_env", nullptr, dist_env_fields(), {}};
  static const TableSchema comm{"comm", nullptr, comm_fields(), {}};
  static const TableSchema pipeline{"distributed.pipeline",
                                    [](Config& c) { c.distributed.pipeline.present = true; },
                                    pipeline_fields(),
                                    {}};
  static const TableSchema moe{
      "distributed.moe", [](Config& c) { c.distributed.moe.present = true; }, moe_fields(), {}};
  static const TableSchema mp_policy{"distributed.mp_policy", nullptr, mp_policy_fields(), {}};
  static const TableSchema distributed{
      "distributed", nullptr, distributed_fields(pipeline, moe, mp_policy), {}};
  static const TableSchema root{
      "",
      nullptr,
      {table_field("model", model), table_field("data", data), table_field("train", train),
       table_field("checkpoint", checkpoint), table_field("dist_env", dist_env),
       table_field("comm", comm), table_field("distributed", distributed)},
      {}};
  return root;
}

}  // namespace meshrun::config_detail
