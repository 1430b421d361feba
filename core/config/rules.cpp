// Rules that involve more than one key and need no world size (the mesh
// rules that do are in core/mesh). They run after every key is applied, so
// the order of keys in the file does not matter.
#include <fmt/format.h>

#include <initializer_list>

#include "config/schema.hpp"

namespace meshrun::config_detail {
namespace {

bool is_set(const Config& config, const std::string& key) { return config.positions.count(key); }

SourcePosition position_of(const Config& config, const std::string& key) {
  const auto it = config.positions.find(key);
  return it == config.positions.end() ? SourcePosition{config.source} : it->second;
}

// Reports a rule at the first of `keys` that was set: that is where the user
// can fix it. When none was set the defaults clash, reported at the first key.
[[noreturn]] void fail_rule(const Config& config, std::initializer_list<std::string> keys,
                            const std::string& what) {
  std::string blamed = *keys.begin();
  for (const auto& key : keys) {
    if (is_set(config, key)) {
      blamed = key;
      break;
    }
  }
  fail(position_of(config, blamed), blamed, what);
}

// "'fsdp2'", marked when it is the default so the user knows why.
std::string strategy_text(const Config& config) {
  return "'" + config.distributed.strategy + "'" +
         (is_set(config, "distributed.strategy") ? "" : " (the default)");
}

void check_train(const Config& config) {
  if (config.train.min_lr > config.train.lr) {
    fail_rule(config, {"train.min_lr", "train.lr"},
              fmt::format("train.min_lr ({}) must be <= train.lr ({})", config.train.min_lr,
                          config.train.lr));
  }
}

void check_pipeline(const Config& config) {
  const PipelineConfig& p = config.distributed.pipeline;
  if (p.pp_batch_size % p.pp_microbatch_size != 0) {
    fail_rule(config,
              {"distributed.pipeline.pp_batch_size", "distributed.pipeline.pp_microbatch_size"},
              fmt::format("distributed.pipeline.pp_batch_size ({}) must be divisible by "
                          "distributed.pipeline.pp_microbatch_size ({})",
                          p.pp_batch_size, p.pp_microbatch_size));
  }
}

std::string strategy_config_name(const std::string& strategy) {
  if (strategy == "ddp") return "DDPConfig";
  if (strategy == "fsdp2") return "FSDP2Config";
  return "MegatronFSDPConfig";
}

// DDPConfig / FSDP2Config / MegatronFSDPConfig keys belong to their strategy;
// a third-party strategy takes none of them.
void check_strategy_keys(const Config& config) {
  const TableSchema& distributed = *root_schema().find("distributed")->table;
  for (const Field& field : distributed.fields) {
    const std::string key = "distributed." + field.name;
    if (field.strategy.empty() || field.strategy == config.distributed.strategy ||
        !is_set(config, key)) {
      continue;
    }
    fail(position_of(config, key), key,
         "only valid with strategy '" + field.strategy + "' (" +
             strategy_config_name(field.strategy) + "), but distributed.strategy is " +
             strategy_text(config));
  }
}

void check_strategy_features(const Config& config) {
  const DistributedConfig& d = config.distributed;
  if (d.sequence_parallel && (d.strategy == "ddp" || d.strategy == "megatron_fsdp")) {
    fail_rule(config, {"distributed.sequence_parallel"},
              "sequence parallelism is supported only by strategy 'fsdp2', but "
              "distributed.strategy is " +
                  strategy_text(config));
  }
  if (d.dp_replicate_size > 1 && d.strategy != "fsdp2") {
    fail_rule(config, {"distributed.dp_replicate_size"},
              fmt::format("dp_replicate_size {} > 1 (HSDP) is supported only by strategy "
                          "'fsdp2', but distributed.strategy is {}",
                          d.dp_replicate_size, strategy_text(config)));
  }
}

// A key meshrun accepts but does not act on: its default is taken (AutoModel
// configs carry the defaults), any other value is refused, so a run never
// silently does less than its config says.
struct Refusal {
  const char* key;
  bool (*departs)(const Config&);  // the value is not what meshrun does
  const char* why;
  const char* fix;  // what would be valid
};

const Refusal kRefusals[] = {
    {"distributed.activation_checkpointing_scope",
     [](const Config& c) { return c.distributed.activation_checkpointing_scope != "all"; },
     "not implemented yet: activation checkpointing checkpoints every layer unit",
     "remove the key or set it to \"all\""},
    {"distributed.autocast_dtype",
     [](const Config& c) { return c.distributed.autocast_dtype == "float16"; },
     "meshrun's models compute on the CPU, where autocast computes in bfloat16 only (as "
     "torch.autocast(\"cpu\") does); float16's narrow range would also need loss scaling",
     "set it to \"bfloat16\" or \"float32\""},
    {"distributed.sequence_parallel",
     [](const Config& c) { return c.distributed.sequence_parallel && c.distributed.tp_size == 1; },
     "needs distributed.tp_size > 1: it shards the activations of tensor-parallel layers on the "
     "sequence, and with tp_size 1 there are none",
     "set it to false"},
    {"distributed.tp_plan",
     [](const Config& c) { return !c.distributed.tp_plan.empty() && c.distributed.tp_size == 1; },
     "needs distributed.tp_size > 1: it says which modules compute over tensor-parallel ranks, "
     "and with tp_size 1 there are none",
     "remove the key"},
    {"distributed.offload_policy",
     [](const Config& c) { return !c.distributed.offload_policy.empty(); },
     "meshrun has no CPU offload: its models compute on the CPU, so parameters, gradients and "
     "optimizer state live in host memory already",
     "remove the key"},
    {"distributed.enable_async_tensor_parallel",
     [](const Config& c) {
       return c.distributed.enable_async_tensor_parallel && c.distributed.tp_size == 1;
     },
     "needs distributed.tp_size > 1: it overlaps the tensor-parallel collectives with compute, "
     "and with tp_size 1 there are none",
     "remove the key or set it to false"},
    {"distributed.enable_compile", [](const Config& c) { return c.distributed.enable_compile; },
     "meshrun has no graph compiler", "remove the key or set it to false"},
    {"distributed.grad_reduce_in_fp32",
     [](const Config& c) { return c.distributed.grad_reduce_in_fp32; },
     "megatron_fsdp reduces gradients in float32 already (the models' dtype); bfloat16 model "
     "weights, whose gradients this would widen, are not implemented yet",
     "remove the key or set it to false"},
    {"distributed.preserve_fp32_weights",
     [](const Config& c) { return !c.distributed.preserve_fp32_weights; },
     "not implemented yet: megatron_fsdp keeps float32 weights, which it also computes with",
     "remove the key or set it to true"},
    {"distributed.fsdp_double_buffer",
     [](const Config& c) {
       return c.distributed.fsdp_double_buffer && c.distributed.zero_dp_strategy < 3;
     },
     "the two gather buffers hold the layer units of zero_dp_strategy 3, which frees each unit "
     "after use; at levels 0-2 every unit stays gathered for the whole step",
     "set distributed.zero_dp_strategy to 3, or fsdp_double_buffer to false"},
    {"distributed.fsdp_double_buffer",
     [](const Config& c) {
       return c.distributed.fsdp_double_buffer && c.distributed.disable_bucketing;
     },
     "the two gather buffers alternate between the layer units, and disable_bucketing gathers "
     "every unit as one bucket",
     "set distributed.disable_bucketing or fsdp_double_buffer to false"},
    {"distributed.calculate_per_token_loss",
     [](const Config& c) { return c.distributed.calculate_per_token_loss; },
     "meshrun's loss is already the mean over the step's tokens: every micro-batch holds "
     "micro_batch_size x seq_len tokens and none is ignored, so summing per token and dividing "
     "by the global token count is the same number; a run would not differ",
     "remove the key or set it to false"},
    {"distributed.nccl_ub", [](const Config& c) { return c.distributed.nccl_ub; },
     "NCCL user buffers register CUDA memory with NCCL (ncclMemAlloc, ncclCommRegister), and "
     "meshrun's megatron_fsdp hands NCCL buffers it allocates with cudaMalloc, unregistered",
     "remove the key or set it to false"},
    {"distributed.keep_fp8_transpose_cache",
     [](const Config& c) { return c.distributed.keep_fp8_transpose_cache; },
     "meshrun has no FP8 compute (its models compute in float32, matmuls optionally in bfloat16), "
     "so there is no FP8 transpose to cache",
     "remove the key or set it to false"},
    {"distributed.moe.ignore_router_for_ac",
     [](const Config& c) { return c.distributed.moe.ignore_router_for_ac; },
     "not implemented yet: activation checkpointing recomputes a layer's router with the rest "
     "of it (the routing comes out the same)",
     "remove the key or set it to false"},
    {"distributed.moe.lm_head_precision",
     [](const Config& c) { return !c.distributed.moe.lm_head_precision.empty(); },
     "not implemented yet: lm_head computes in the model's precision (float32, or "
     "distributed.autocast_dtype's matmuls)",
     "remove the key"},
    {"distributed.moe.wrap_outer_model",
     [](const Config& c) { return !c.distributed.moe.wrap_outer_model; },
     "not implemented yet: the root (embeddings, final norm, lm_head) is always one FSDP2 unit",
     "remove the key or set it to true"},
};

void check_refused_values(const Config& config) {
  for (const Refusal& refusal : kRefusals) {
    if (is_set(config, refusal.key) && refusal.departs(config)) {
      fail(position_of(config, refusal.key), refusal.key,
           std::string(refusal.why) + "; " + refusal.fix);
    }
  }
}

// pp_seq_len is AutoModel's sequence length of the pipeline's messages;
// meshrun's pipeline sends the training sequences, data.seq_len long.
void check_pipeline_sequence(const Config& config) {
  const int64_t pp_seq_len = config.distributed.pipeline.pp_seq_len;
  if (pp_seq_len == 0 || pp_seq_len == config.data.seq_len) return;
  fail_rule(config, {"distributed.pipeline.pp_seq_len"},
            fmt::format("{} differs from data.seq_len ({}): the pipeline sends the training "
                        "sequences; remove the key, or set it to 0 or to data.seq_len",
                        pp_seq_len, config.data.seq_len));
}

void check_parallel_tables(Config& config) {
  const DistributedConfig& d = config.distributed;
  if (d.pipeline.present && d.pp_size <= 1) {
    config.warnings.push_back(config.where("distributed.pipeline") +
                              ": distributed.pipeline: ignored: the table applies only when "
                              "distributed.pp_size > 1 (pp_size is " +
                              std::to_string(d.pp_size) + ")");
  }
  if (d.pp_size > 1 && !d.pipeline.present) {
    fail_rule(config, {"distributed.pp_size"},
              fmt::format("pp_size {} > 1 needs a [distributed.pipeline] table; an empty "
                          "[distributed.pipeline] table selects the defaults",
                          d.pp_size));
  }
  if (d.moe.present && d.ep_size <= 1) {
    fail_rule(config, {"distributed.moe"},
              fmt::format("a [distributed.moe] table needs distributed.ep_size > 1 (ep_size is "
                          "{}); set ep_size or remove the table",
                          d.ep_size));
  }
}

// The comm plugin follows the device unless [comm] names one: a CPU comm
// backend cannot move CUDA tensors, nor NCCL host ones.
void resolve_comm_backend(Config& config) {
  const bool named = config.positions.contains("comm.backend");
  const bool cuda = config.dist_env.on_cuda();
  if (!named) {
    config.comm.backend = cuda ? "nccl" : "mpi";
    return;
  }
  const std::string& comm = config.comm.backend;
  if (cuda && comm == "mpi") {
    fail_rule(config, {"comm.backend"},
              "\"mpi\" moves host memory, and dist_env.backend = \"nccl\" places every rank on "
              "a CUDA GPU; remove the key (the device's backend, nccl, is the default)");
  }
  if (!cuda && comm == "nccl") {
    fail_rule(config, {"comm.backend"},
              fmt::format("\"nccl\" moves CUDA device memory, and dist_env.backend = \"{}\" "
                          "places every rank on the CPU; set dist_env.backend = \"nccl\" to "
                          "train on GPUs",
                          config.dist_env.backend));
  }
}

}  // namespace

void check_cross_key_rules(Config& config) {
  resolve_comm_backend(config);
  check_train(config);
  check_pipeline(config);
  check_strategy_keys(config);
  check_strategy_features(config);
  check_parallel_tables(config);
  check_refused_values(config);
  check_pipeline_sequence(config);
}

}  // namespace meshrun::config_detail
