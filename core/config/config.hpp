// The run configuration: a TOML file whose tables and keys follow Hugging
// Face config.json names ([model]) and NeMo AutoModel's distributed section
// ([distributed], [distributed.pipeline], [distributed.moe]).
//
// Parsing validates everything that can be checked without a world size:
// unknown keys (with a "did you mean"), types, ranges, enumerations, and
// cross-key rules. Every error is a meshrun::Error (INVALID_ARGUMENT) whose
// message starts with "FILE:LINE:COL: key.path:" (or "override 'k=v':" for a
// command-line override) and says what would be valid.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace meshrun {

// Where a key's value came from.
struct SourcePosition {
  std::string source;  // file name, "<string>", or "override 'k=v'"
  int64_t line = 0;    // 1-based; 0 when unknown (overrides, defaults)
  int64_t column = 0;
  // "file:line:col", or just the source when line is 0.
  std::string str() const;
};

// [model]: Hugging Face config.json key names. The core reads three; the
// others describe the architecture and belong to the model plugin of
// model_type, which checks them when the plan is made.
struct ModelConfig {
  std::string model_type = "llama";     // selects the model and sidecar plugins
  std::string torch_dtype = "float32";  // parameter storage: float32 | bfloat16
  std::string checkpoint;               // directory with consolidated weights to start from
  nlohmann::ordered_json architecture = nlohmann::ordered_json::object();  // the other keys
};

// [data]: byte-level text.
struct DataConfig {
  std::string path = "/usr/share/common-licenses/GPL-3";
  double val_fraction = 0.05;  // held-out tail of the file, in [0, 1)
  int64_t seq_len = 256;
};

// [train]
struct TrainConfig {
  int64_t steps = 100;
  int64_t global_batch_size = 16;  // sequences per optimizer step
  int64_t micro_batch_size = 4;    // sequences per rank per forward/backward
  double lr = 3e-3;
  double min_lr = 3e-4;  // end of the cosine decay
  int64_t warmup_steps = 10;
  double beta1 = 0.9;  // TOML: betas = [b1, b2]
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;  // 0 disables clipping
  int64_t seed = 1234;
  int64_t val_every = 50;  // 0: only at the end
  int64_t log_every = 1;
  // Steps in a row whose loss or gradient norm is not finite that are
  // skipped (no update) before the run stops; 0 stops at the first.
  int64_t skip_nonfinite_steps = 0;
  // Write a timeline of every rank to OUTPUT/trace.json (train/trace.hpp).
  bool profile = false;
};

// [checkpoint]
struct CheckpointConfig {
  int64_t save_every = 0;           // 0: no sharded checkpoints
  std::string resume_from;          // DIR/checkpoints/step_N
  bool export_consolidated = true;  // TOML key: export
};

// [comm]
// [dist_env]: AutoModel's dist_env: the device a rank computes on, by the
// torch.distributed backend that would serve it.
struct DistEnvConfig {
  std::string backend = "mpi";  // "nccl": a CUDA GPU per local rank; "gloo", "mpi": the CPU
  bool on_cuda() const { return backend == "nccl"; }
};

// [comm]: the comm plugin (by default dist_env's: "nccl" for CUDA, "mpi"
// for the CPU) and the deadline of every collective.
struct CommConfig {
  std::string backend = "mpi";
  double timeout_minutes = 10.0;  // applies to every communicator the mesh creates
};

// [distributed.pipeline]: AutoModel's PipelineConfig.
struct PipelineConfig {
  bool present = false;  // the table appeared (possibly empty)
  std::string pp_schedule = "1f1b";
  std::string pp_schedule_csv;  // path; when set it replaces pp_schedule
  int64_t pp_microbatch_size = 1;
  int64_t pp_batch_size = 1;     // divisible by pp_microbatch_size
  int64_t layers_per_stage = 0;  // 0: unset (one stage per rank, two for multi-stage schedules)
  std::string round_virtual_stages_to_pp_multiple;  // "", "up" or "down"
  std::vector<std::vector<std::string>> module_fqns_per_model_part;
  bool scale_grads_in_schedule = false;
  int64_t pp_seq_len = 0;  // 0: data.seq_len
  bool pp_recv_buffer_pool = false;
};

// [distributed.mp_policy]: FSDP2's MixedPrecisionPolicy with AutoModel's
// defaults: bfloat16 parameters for compute, float32 gradient reduction,
// float32 outputs, inputs cast to the parameter dtype. Master weights and
// optimizer state stay float32.
struct MixedPrecisionConfig {
  std::string param_dtype = "bfloat16";
  std::string reduce_dtype = "float32";
  std::string output_dtype = "float32";
  bool cast_forward_inputs = true;
};

// [distributed.moe]: AutoModel's MoEParallelizerConfig.
struct MoeConfig {
  bool present = false;
  bool ignore_router_for_ac = false;
  bool reshard_after_forward = false;
  std::string lm_head_precision;  // "" or a dtype name
  bool wrap_outer_model = true;
};

// [distributed]: AutoModel's distributed section. Strategy-specific keys are
// accepted only for their strategy.
struct DistributedConfig {
  std::string strategy = "fsdp2";  // canonical: aliases resolved (megatron-fsdp, mfsdp)
  int64_t dp_size = 0;             // 0: world / (tp * cp * pp)
  int64_t dp_replicate_size = 1;
  int64_t tp_size = 1;
  int64_t pp_size = 1;
  int64_t cp_size = 1;
  // How cp ranks share attention (ring x Ulysses = cp_size); 0: the other
  // degree decides, ring when both are 0.
  int64_t cp_ring_degree = 0;
  int64_t cp_ulysses_degree = 0;
  int64_t ep_size = 1;
  bool sequence_parallel = false;
  std::string activation_checkpointing;  // "" (off), "full" or "selective"; TOML true = "full"
  std::string activation_checkpointing_scope = "all";
  std::string autocast_dtype;  // "" or a dtype name

  // DDPConfig
  bool broadcast_buffers = false;
  bool find_unused_parameters = false;
  bool static_graph = false;
  double bucket_cap_mb = 25.0;
  bool gradient_as_bucket_view = false;

  // FSDP2Config
  std::string tp_plan;  // "" or a plan name/path
  std::string offload_policy;
  bool defer_fsdp_grad_sync = true;
  std::optional<bool> reshard_after_forward;  // unset: AutoModel's heuristic
  bool enable_async_tensor_parallel = false;
  bool enable_compile = false;
  bool enable_fsdp2_prefetch = true;
  int64_t fsdp2_forward_prefetch_depth = 1;
  int64_t fsdp2_backward_prefetch_depth = 2;
  MixedPrecisionConfig mp_policy;

  // MegatronFSDPConfig
  int64_t zero_dp_strategy = 3;
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = true;
  bool grad_reduce_in_fp32 = false;
  bool preserve_fp32_weights = true;
  bool fsdp_double_buffer = false;
  bool disable_bucketing = false;
  bool average_in_collective = false;
  bool report_nan_in_param_grad = false;
  bool check_for_nan_in_grad = false;
  bool calculate_per_token_loss = false;
  bool init_fsdp_with_meta_device = false;
  bool nccl_ub = false;
  bool keep_fp8_transpose_cache = false;
  std::vector<std::string> megatron_fsdp_unit_modules;

  PipelineConfig pipeline;
  MoeConfig moe;
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  DistEnvConfig dist_env;
  CommConfig comm;
  DistributedConfig distributed;

  std::string source;                               // file name or "<string>"
  std::map<std::string, SourcePosition> positions;  // every key that was set, by dotted path
  std::vector<std::string> warnings;                // non-fatal findings, one line each

  // Where `key` (dotted path) was set: "file:line:col", "override 'k=v'", or
  // the source name when the key took its default.
  std::string where(std::string_view key) const;
};

// Parses TOML text, applies "key.path=value" overrides (each value read as a
// TOML value, else as a bare string), and validates. Throws meshrun::Error.
Config parse_config(std::string_view toml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides = {});

// Reads the file at `path` (NOT_FOUND when it cannot be read) and parses it.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Every value key the schema accepts, dotted ("distributed.pipeline.pp_seq_len"),
// in schema order: what a test walks to give every key a verdict. [model]'s
// architecture keys are not listed: they are the model plugin's.
std::vector<std::string> config_keys();

// " (it belongs in [distributed])" when another table of the config has a
// key called `name`, else "": for messages about a misplaced key.
std::string misplaced_key_hint(std::string_view name, std::string_view table);

// The canonical strategy name: "megatron-fsdp" and "mfsdp" become
// "megatron_fsdp"; other names are returned as given.
std::string canonical_strategy_name(std::string_view name);

}  // namespace meshrun
