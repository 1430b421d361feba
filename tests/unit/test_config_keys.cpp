// Every key the config schema accepts has a verdict: a non-default value
// changes the plan or the options a strategy receives, is checked against
// the keys it must agree with, drives a named trainer behaviour, or is
// refused naming the key, its position and why. The keys come from the
// schema itself, so a key added without a verdict fails here.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "errors.hpp"
#include "plan/plan.hpp"
#include "strategy/strategy.hpp"
#include "temp_folder.hpp"

namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;
using meshrun::Config;

enum class Kind {
  plan,     // `meshrun plan --json` differs
  options,  // the options JSON the strategy receives differs
  checked,  // `value` is refused naming the key, `accepted` (agreeing) is taken
  trainer,  // taken; `where` names the trainer behaviour and the test observing it
  refused,  // `value` is refused naming the key; `accepted` (the default) is taken
};

struct Verdict {
  Kind kind;
  std::string value;                 // a TOML value other than the default
  std::vector<std::string> context;  // overrides the value needs to apply
  std::string accepted;              // checked, refused: a value taken ("": none to write)
  std::string where;                 // trainer
};

const std::vector<std::string> kDdp = {"distributed.strategy=ddp"};
const std::vector<std::string> kMegatron = {"distributed.strategy=megatron_fsdp"};
const std::vector<std::string> kMoe = {"distributed.ep_size=2", "model.model_type=\"mixtral\""};
const std::vector<std::string> kPipeline = {"model.num_hidden_layers=4", "distributed.pp_size=2",
                                            "distributed.pipeline.pp_schedule=1f1b"};

std::vector<std::string> with(std::vector<std::string> context,
                              const std::vector<std::string>& more) {
  context.insert(context.end(), more.begin(), more.end());
  return context;
}

Verdict plan_change(std::string value, std::vector<std::string> context = {}) {
  return {Kind::plan, std::move(value), std::move(context), "", ""};
}

Verdict options_change(std::string value, std::vector<std::string> context = {}) {
  return {Kind::options, std::move(value), std::move(context), "", ""};
}

Verdict checked(std::string value, std::string accepted, std::vector<std::string> context = {}) {
  return {Kind::checked, std::move(value), std::move(context), std::move(accepted), ""};
}

Verdict trainer(std::string value, std::string where, std::vector<std::string> context = {}) {
  return {Kind::trainer, std::move(value), std::move(context), "", std::move(where)};
}

Verdict refused(std::string value, std::string accepted, std::vector<std::string> context = {}) {
  return {Kind::refused, std::move(value), std::move(context), std::move(accepted), ""};
}

std::map<std::string, Verdict> verdicts(const std::string& csv) {
  const std::string split =
      R"([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.layers.2", )"
      R"("model.layers.3", "model.norm", "lm_head"]])";
  return {
      {"model.model_type", plan_change("\"gpt2\"")},
      {"model.torch_dtype",
       trainer("\"bfloat16\"", "parameters stored rounded to bfloat16 (test_train.py)")},
      {"model.checkpoint",
       trainer("\"/nonexistent\"", "starts from exported weights (test_train.py)")},
      {"data.path", trainer("\"/etc/hostname\"", "the training bytes (test_train.py)")},
      {"data.val_fraction", trainer("0.1", "the held-out tail for val_loss (test_train.py)")},
      {"data.seq_len", trainer("64", "the sequence length trained (test_train.py)")},
      {"train.steps", trainer("3", "optimizer steps run (every train test)")},
      {"train.global_batch_size", trainer("32", "sequences per step (test_train.py)")},
      {"train.micro_batch_size", trainer("2", "gradient accumulation (test_train.py)")},
      {"train.lr", trainer("0.01", "AdamW's peak learning rate (test_train_pieces.cpp)")},
      {"train.min_lr", trainer("0.0", "the end of the cosine decay (test_train_pieces.cpp)")},
      {"train.warmup_steps", trainer("0", "linear warm-up (test_train_pieces.cpp)")},
      {"train.betas", trainer("[0.8, 0.9]", "AdamW's betas (test_train_pieces.cpp)")},
      {"train.eps", trainer("1e-6", "AdamW's eps (test_train_pieces.cpp)")},
      {"train.weight_decay", trainer("0.0", "AdamW's decay (test_train_pieces.cpp)")},
      {"train.max_grad_norm", trainer("0.5", "gradient clipping (test_train.py)")},
      {"train.seed", trainer("7", "initial weights and data order (test_train.py)")},
      {"train.val_every", trainer("5", "validation cadence (test_train.py)")},
      {"train.log_every", trainer("5", "metrics cadence (test_train.py)")},
      {"train.skip_nonfinite_steps", trainer("2", "non-finite steps skipped (test_faults.py)")},
      {"train.profile", trainer("true", "trace.json written (test_profile.py)")},
      {"checkpoint.save_every", trainer("2", "sharded checkpoints (test_checkpoint.py)")},
      {"checkpoint.resume_from", trainer("\"/nonexistent\"", "resumes (test_checkpoint.py)")},
      {"checkpoint.export", trainer("false", "no consolidated export (test_train.py)")},
      {"dist_env.backend", refused("\"nccl\"", "\"gloo\"")},
      {"comm.backend", refused("\"nccl\"", "\"mpi\"")},
      {"comm.timeout_minutes", trainer("0.5", "a hung rank's deadline (test_faults.py)")},
      {"distributed.strategy", plan_change("\"ddp\"")},
      {"distributed.dp_size", plan_change("2")},
      {"distributed.dp_replicate_size", plan_change("2")},
      {"distributed.tp_size", plan_change("2")},
      {"distributed.pp_size", plan_change("2", with(kPipeline, {"distributed.pp_size=1"}))},
      {"distributed.cp_size", plan_change("2")},
      {"distributed.cp_ring_degree", plan_change("1", {"distributed.cp_size=2"})},
      {"distributed.cp_ulysses_degree", plan_change("2", {"distributed.cp_size=2"})},
      {"distributed.ep_size", plan_change("2", {"model.model_type=\"mixtral\""})},
      {"distributed.sequence_parallel", plan_change("true", {"distributed.tp_size=2"})},
      {"distributed.activation_checkpointing", plan_change("true")},
      {"distributed.activation_checkpointing_scope", refused("\"layers\"", "\"all\"")},
      // fsdp2's default mp_policy computes in bfloat16: float32 changes the plan.
      {"distributed.autocast_dtype", plan_change("\"float32\"")},
      {"distributed.pipeline.pp_schedule", plan_change("\"gpipe\"", kPipeline)},
      {"distributed.pipeline.pp_schedule_csv", plan_change("\"" + csv + "\"", kPipeline)},
      {"distributed.pipeline.pp_microbatch_size",
       trainer("2", "microbatches per step (test_pipeline.py)",
               {"distributed.pipeline.pp_batch_size=4"})},
      {"distributed.pipeline.pp_batch_size", checked("4", "16", kPipeline)},  // global 16 / dp 1
      {"distributed.pipeline.layers_per_stage", plan_change("1", kPipeline)},
      {"distributed.pipeline.round_virtual_stages_to_pp_multiple",
       plan_change(
           "\"up\"",
           with(kPipeline, {"model.num_hidden_layers=6", "distributed.pipeline.layers_per_stage=2",
                            "distributed.pipeline.round_virtual_stages_to_pp_multiple=down"}))},
      {"distributed.pipeline.module_fqns_per_model_part", plan_change(split, kPipeline)},
      {"distributed.pipeline.scale_grads_in_schedule",
       trainer("true", "the loss scale seeded per microbatch (test_pipeline.py)")},
      {"distributed.pipeline.pp_seq_len", checked("32", "256")},  // data.seq_len
      {"distributed.pipeline.pp_recv_buffer_pool",
       trainer("true", "received activations pooled, the same losses (test_pipeline.py)")},
      {"distributed.moe.ignore_router_for_ac", refused("true", "false", kMoe)},
      {"distributed.moe.reshard_after_forward",
       trainer("true", "the experts' FSDP2 reshards after forward (test_moe.py)", kMoe)},
      {"distributed.moe.lm_head_precision", refused("\"float32\"", "", kMoe)},
      {"distributed.moe.wrap_outer_model", refused("false", "true", kMoe)},
      {"distributed.broadcast_buffers", options_change("true", kDdp)},
      {"distributed.find_unused_parameters", options_change("true", kDdp)},
      {"distributed.static_graph", options_change("true", kDdp)},
      {"distributed.bucket_cap_mb", options_change("10", kDdp)},
      {"distributed.gradient_as_bucket_view", options_change("true", kDdp)},
      {"distributed.tp_plan", plan_change("\"layers\"", {"distributed.tp_size=2"})},
      {"distributed.offload_policy", refused("\"cpu\"", "\"\"")},
      {"distributed.defer_fsdp_grad_sync", options_change("false")},
      {"distributed.reshard_after_forward", options_change("true")},
      {"distributed.enable_async_tensor_parallel", plan_change("true", {"distributed.tp_size=2"})},
      {"distributed.enable_compile", refused("true", "false")},
      {"distributed.enable_fsdp2_prefetch", options_change("false")},
      {"distributed.fsdp2_forward_prefetch_depth", options_change("2")},
      {"distributed.fsdp2_backward_prefetch_depth", options_change("1")},
      {"distributed.mp_policy.param_dtype", options_change("\"float32\"")},
      {"distributed.mp_policy.reduce_dtype", options_change("\"bfloat16\"")},
      {"distributed.mp_policy.output_dtype", options_change("\"bfloat16\"")},
      {"distributed.mp_policy.cast_forward_inputs", options_change("false")},
      {"distributed.zero_dp_strategy", options_change("2", kMegatron)},
      {"distributed.overlap_grad_reduce", options_change("false", kMegatron)},
      {"distributed.overlap_param_gather", options_change("false", kMegatron)},
      {"distributed.grad_reduce_in_fp32", refused("true", "false", kMegatron)},
      {"distributed.preserve_fp32_weights", refused("false", "true", kMegatron)},
      {"distributed.fsdp_double_buffer", options_change("true", kMegatron)},
      {"distributed.disable_bucketing", options_change("true", kMegatron)},
      {"distributed.average_in_collective", options_change("true", kMegatron)},
      {"distributed.report_nan_in_param_grad", options_change("true", kMegatron)},
      {"distributed.check_for_nan_in_grad", options_change("true", kMegatron)},
      {"distributed.calculate_per_token_loss", refused("true", "false", kMegatron)},
      {"distributed.init_fsdp_with_meta_device",
       trainer("true", "each rank starts only its shard (test_megatron_fsdp.py)", kMegatron)},
      {"distributed.nccl_ub", refused("true", "false", kMegatron)},
      {"distributed.keep_fp8_transpose_cache", refused("true", "false", kMegatron)},
      {"distributed.megatron_fsdp_unit_modules",
       checked("[\"LlamaMLP\"]", "[\"transformers.models.llama.modeling_llama.LlamaDecoderLayer\"]",
               kMegatron)},
  };
}

const meshrun::PluginLoader& loader() {
  static const meshrun::PluginLoader instance = meshrun::PluginLoader::from_environment();
  return instance;
}

// "[distributed.moe]\nwrap_outer_model = false\n": the key at cfg.toml:2:1.
std::string file_setting(const std::string& key, const std::string& value) {
  const size_t dot = key.rfind('.');
  return fmt::format("[{}]\n{} = {}\n", key.substr(0, dot), key.substr(dot + 1), value);
}

Config parsed_config(const std::string& text, const std::vector<std::string>& overrides) {
  return meshrun::parse_config(text, "cfg.toml", overrides);
}

std::string plan_json(const std::string& text, const std::vector<std::string>& overrides) {
  const Config config = parsed_config(text, overrides);
  const meshrun::Plan plan =
      meshrun::make_plan(config, meshrun::default_world_size(config), loader());
  return meshrun::plan_to_json(plan, false).dump();
}

std::string options_json(const std::string& text, const std::vector<std::string>& overrides) {
  return meshrun::strategy_options_json(parsed_config(text, overrides).distributed);
}

// The input error that parsing and planning `text` raise; fails without one.
meshrun::Error refusal_of(const std::string& text, const std::vector<std::string>& overrides) {
  try {
    plan_json(text, overrides);
  } catch (const meshrun::Error& error) {
    return error;
  }
  FAIL("taken: " << text);
  return meshrun::Error(MESHRUN_INTERNAL, "unreachable");
}

void check_refused(const std::string& key, const Verdict& verdict) {
  const meshrun::Error error = refusal_of(file_setting(key, verdict.value), verdict.context);
  INFO(error.what());
  CHECK(error.is_input_error());
  CHECK(error.key() == key);
  CHECK_THAT(error.what(), StartsWith("cfg.toml:2:1: " + key + ": "));
  if (!verdict.accepted.empty()) {
    CHECK_NOTHROW(plan_json(file_setting(key, verdict.accepted), verdict.context));
  }
}

}  // namespace

TEST_CASE("config keys: every key the schema accepts has a verdict", "[config][keys]") {
  const TempFolder folder("meshrun-keys");
  const std::string csv = folder.path() + "/1f1b.csv";
  std::ofstream(csv) << "0F0,0B0\n,1F0\n";
  const std::map<std::string, Verdict> table = verdicts(csv);
  std::set<std::string> walked;
  for (const std::string& key : meshrun::config_keys()) {
    walked.insert(key);
    const auto found = table.find(key);
    INFO("key " << key);
    REQUIRE(found != table.end());  // a new key needs a verdict above
    const Verdict& verdict = found->second;
    const std::vector<std::string> changed = with(verdict.context, {key + "=" + verdict.value});
    switch (verdict.kind) {
      case Kind::plan:
        CHECK(plan_json("", verdict.context) != plan_json("", changed));
        break;
      case Kind::options:
        CHECK(options_json("", verdict.context) != options_json("", changed));
        break;
      case Kind::trainer:
        CHECK_FALSE(verdict.where.empty());
        CHECK(parsed_config("", changed).positions.count(key) == 1);
        break;
      case Kind::checked:
      case Kind::refused:
        check_refused(key, verdict);
        break;
    }
  }
  for (const auto& [key, verdict] : table) {
    INFO("verdict for a key the schema does not have: " << key);
    CHECK(walked.count(key) == 1);
  }
}

TEST_CASE("config keys: a refusal says why and what would be valid", "[config][keys]") {
  const auto message = [](const std::string& key, const std::string& value,
                          const std::vector<std::string>& context = {}) {
    return std::string(refusal_of(file_setting(key, value), context).what());
  };
  CHECK_THAT(message("distributed.enable_compile", "true"),
             Contains("meshrun has no graph compiler; remove the key or set it to false"));
  CHECK_THAT(message("distributed.autocast_dtype", "\"float16\""),
             Contains("autocast computes in bfloat16 only"));
  CHECK_THAT(message("distributed.autocast_dtype", "\"float16\""),
             Contains("set it to \"bfloat16\" or \"float32\""));
  CHECK_THAT(message("distributed.tp_plan", "\"layers\""),
             Contains("needs distributed.tp_size > 1"));
  CHECK_THAT(message("distributed.fsdp_double_buffer", "true",
                     with(kMegatron, {"distributed.zero_dp_strategy=2"})),
             Contains("at levels 0-2 every unit stays gathered for the whole step; set "
                      "distributed.zero_dp_strategy to 3, or fsdp_double_buffer to false"));
  CHECK_THAT(message("distributed.nccl_ub", "true", kMegatron),
             Contains("megatron_fsdp hands NCCL buffers it allocates with cudaMalloc"));
  CHECK_THAT(message("distributed.pipeline.pp_seq_len", "32"),
             Contains("differs from data.seq_len (256)"));
  CHECK_THAT(message("distributed.pipeline.pp_batch_size", "4", kPipeline),
             Contains("train.global_batch_size (16) / dp (1), is 16; set it to 16"));
}
