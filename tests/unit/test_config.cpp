// The TOML config loader: defaults, a full file, one test per validation
// rule (the message names the key and its position), overrides, and bad
// input (syntax, types, overflow, random bytes, missing files).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <catch2/catch.hpp>

#include "config/config.hpp"
#include "errors.hpp"
#include "mesh/device.hpp"
#include "temp_folder.hpp"
#include "train/rank_gpu.hpp"
#include "train/run.hpp"

namespace {

using Catch::Contains;
using Catch::EndsWith;
using Catch::StartsWith;
using meshrun::Config;
using meshrun::parse_config;

struct Failure {
  std::string message;
  std::string key;
  int32_t code = 0;
};

Config parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_config(text, "cfg.toml", overrides);
}

// The error parse_config raises for `text`; fails the test when there is none.
Failure failure_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  try {
    parse(text, overrides);
  } catch (const meshrun::Error& error) {
    CHECK(std::string(error.what()).find('\n') == std::string::npos);
    return {error.what(), error.key(), error.code()};
  }
  FAIL("no error for:\n" << text);
  return {};
}

// The error for "[table]\n<assignment>\n<rest>": the key sits at line 2, column 1.
Failure failure_in(const std::string& table, const std::string& assignment,
                   const std::string& rest = "") {
  return failure_of("[" + table + "]\n" + assignment + "\n" + rest);
}

void expect_rejected(const Failure& failure, const std::string& key, const std::string& fragment,
                     const std::string& position = "cfg.toml:2:1") {
  INFO(failure.message);
  CHECK(failure.code == MESHRUN_INVALID_ARGUMENT);
  CHECK(failure.key == key);
  CHECK_THAT(failure.message, StartsWith(position + ": " + key + ": "));
  CHECK_THAT(failure.message, Contains(fragment));
}

// One rejected value: "[table]\n<assignment>" must fail on `key` saying `fragment`.
struct BadValue {
  std::string table;
  std::string assignment;
  std::string fragment;
};

void expect_all_rejected(const std::vector<BadValue>& cases, const std::string& rest = "") {
  for (const auto& bad : cases) {
    const std::string name = bad.assignment.substr(0, bad.assignment.find(' '));
    INFO("[" << bad.table << "] " << bad.assignment);
    expect_rejected(failure_in(bad.table, bad.assignment, rest), bad.table + "." + name,
                    bad.fragment);
  }
}

const char* const kFullConfig = R"(# every table
[model]
model_type = "llama"
vocab_size = 256
hidden_size = 128
intermediate_size = 384
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 512
rms_norm_eps = 1e-6
rope_theta = 500000.0
tie_word_embeddings = false
torch_dtype = "bfloat16"
checkpoint = "runs/old"

[data]
path = "/tmp/text"
val_fraction = 0.1
seq_len = 64

[train]
steps = 7
global_batch_size = 8
micro_batch_size = 2
lr = 1e-3
min_lr = 1e-4
warmup_steps = 2
betas = [0.8, 0.99]
eps = 1e-6
weight_decay = 0.0
max_grad_norm = 0.5
seed = 42
val_every = 3
log_every = 2

[checkpoint]
save_every = 5
resume_from = "runs/a/checkpoints/step_5"
export = false

[dist_env]
backend = "nccl"

[comm]
backend = "nccl"
timeout_minutes = 2.5

[distributed]
strategy = "fsdp2"
dp_size = 2
dp_replicate_size = 1
tp_size = 2
pp_size = 2
cp_size = 1
ep_size = 2
sequence_parallel = true
activation_checkpointing = "selective"
activation_checkpointing_scope = "all"
autocast_dtype = "bfloat16"
tp_plan = ""
offload_policy = ""
defer_fsdp_grad_sync = false
reshard_after_forward = true
enable_async_tensor_parallel = false
enable_compile = false
enable_fsdp2_prefetch = false
fsdp2_forward_prefetch_depth = 0
fsdp2_backward_prefetch_depth = 3

[distributed.pipeline]
pp_schedule = "interleaved_1f1b"
pp_schedule_csv = "sched.csv"
pp_microbatch_size = 2
pp_batch_size = 8
layers_per_stage = 1
round_virtual_stages_to_pp_multiple = "up"
module_fqns_per_model_part = [["model.embed_tokens", "model.layers.0"], ["model.layers.1"]]
scale_grads_in_schedule = true
pp_seq_len = 64
pp_recv_buffer_pool = false

[distributed.moe]
ignore_router_for_ac = false
reshard_after_forward = false
wrap_outer_model = true
)";

}  // namespace

TEST_CASE("config: an empty document gives the documented defaults", "[config]") {
  const Config config = parse("");
  CHECK(config.source == "cfg.toml");
  CHECK(config.positions.empty());
  CHECK(config.warnings.empty());
  CHECK(config.model.model_type == "llama");
  CHECK(config.model.architecture == nlohmann::ordered_json::object());
  CHECK(config.model.torch_dtype == "float32");
  CHECK(config.data.path == "/usr/share/common-licenses/GPL-3");
  CHECK(config.data.val_fraction == 0.05);
  CHECK(config.train.beta1 == 0.9);
  CHECK(config.train.beta2 == 0.95);
  CHECK(config.checkpoint.export_consolidated);
  CHECK(config.comm.backend == "mpi");
  CHECK(config.distributed.strategy == "fsdp2");
  CHECK(config.distributed.dp_size == 0);
  CHECK(config.distributed.activation_checkpointing.empty());
  CHECK_FALSE(config.distributed.reshard_after_forward.has_value());
  CHECK(config.distributed.zero_dp_strategy == 3);
  CHECK_FALSE(config.distributed.pipeline.present);
  CHECK(config.distributed.pipeline.pp_schedule == "1f1b");
  CHECK_FALSE(config.distributed.moe.present);
}

TEST_CASE("config: SourcePosition::str and Config::where", "[config]") {
  CHECK(meshrun::SourcePosition{"a.toml", 3, 7}.str() == "a.toml:3:7");
  CHECK(meshrun::SourcePosition{"override 'x=1'"}.str() == "override 'x=1'");
  const Config config = parse("[train]\n  steps = 3\n");
  CHECK(config.where("train.steps") == "cfg.toml:2:3");
  CHECK(config.where("train") == "cfg.toml:1:2");
  CHECK(config.where("train.lr") == "cfg.toml");
}

TEST_CASE("config: a full file sets every table and records key positions", "[config]") {
  const Config config = parse(kFullConfig);
  CHECK(config.model.architecture.at("hidden_size") == 128);
  CHECK(config.model.architecture.at("num_key_value_heads") == 2);
  CHECK(config.model.architecture.at("rms_norm_eps") == 1e-6);
  CHECK(config.model.architecture.at("tie_word_embeddings") == false);
  CHECK(config.model.torch_dtype == "bfloat16");
  CHECK(config.model.checkpoint == "runs/old");
  CHECK(config.data.seq_len == 64);
  CHECK(config.train.beta1 == 0.8);
  CHECK(config.train.beta2 == 0.99);
  CHECK(config.train.seed == 42);
  CHECK_FALSE(config.checkpoint.export_consolidated);
  CHECK(config.checkpoint.resume_from == "runs/a/checkpoints/step_5");
  CHECK(config.comm.timeout_minutes == 2.5);
  const auto& d = config.distributed;
  CHECK(d.dp_size == 2);
  CHECK(d.tp_size == 2);
  CHECK(d.activation_checkpointing == "selective");
  CHECK(d.autocast_dtype == "bfloat16");
  CHECK(d.reshard_after_forward == std::optional<bool>(true));
  CHECK(d.fsdp2_backward_prefetch_depth == 3);
  CHECK(d.pipeline.present);
  CHECK(d.pipeline.pp_schedule == "interleaved_1f1b");
  CHECK(d.pipeline.round_virtual_stages_to_pp_multiple == "up");
  CHECK(d.pipeline.module_fqns_per_model_part ==
        std::vector<std::vector<std::string>>{{"model.embed_tokens", "model.layers.0"},
                                              {"model.layers.1"}});
  CHECK(d.pipeline.pp_seq_len == 64);
  CHECK(d.moe.present);
  CHECK(d.moe.wrap_outer_model);
  CHECK(config.warnings.empty());
  CHECK(config.where("model.vocab_size") == "cfg.toml:4:1");
  CHECK(config.where("distributed.pipeline.pp_schedule") == "cfg.toml:72:1");
  CHECK(config.positions.count("distributed.moe") == 1);
}

// The model plugin checks these when the plan is made (test_model_plugin.cpp).
TEST_CASE("config: [model] keeps the architecture keys, typed, for the model plugin", "[config]") {
  const Config config = parse(
      "[model]\nmodel_type = 'gpt2'\nn_embd = 64\nlayer_norm_epsilon = 1e-5\n"
      "activation_function = 'gelu_new'\nscale_attn_weights = true\nsizes = [1, 2]\n"
      "[model.rope_scaling]\nfactor = 2.0\n",
      {"model.n_layer=3", "model.banana=yellow"});
  const auto& keys = config.model.architecture;
  CHECK(config.model.model_type == "gpt2");
  CHECK(keys.at("n_embd") == 64);
  CHECK(keys.at("layer_norm_epsilon") == 1e-5);
  CHECK(keys.at("activation_function") == "gelu_new");
  CHECK(keys.at("scale_attn_weights") == true);
  CHECK(keys.at("sizes") == nlohmann::ordered_json::array({1, 2}));
  CHECK(keys.at("rope_scaling").at("factor") == 2.0);
  CHECK(keys.at("n_layer") == 3);
  CHECK(keys.at("banana") == "yellow");
  CHECK_FALSE(keys.contains("model_type"));
  CHECK(config.where("model.n_embd") == "cfg.toml:3:1");
  CHECK(config.where("model.n_layer") == "override 'model.n_layer=3'");
}

TEST_CASE("config: integers are accepted where floats are expected", "[config]") {
  const Config config = parse("[train]\nlr = 1\nmin_lr = 0\nbetas = [0, 0.5]\n");
  CHECK(config.train.lr == 1.0);
  CHECK(config.train.min_lr == 0.0);
  CHECK(config.train.beta1 == 0.0);
}

TEST_CASE("config: TOML syntax errors name file, line and column", "[config][bad-input]") {
  const Failure failure = failure_of("[train]\nsteps = = 3\n");
  CHECK(failure.code == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(failure.message, StartsWith("cfg.toml:2:"));
  CHECK_THAT(failure.message, Contains(": TOML syntax error: "));
  CHECK_THAT(failure_of("[train]\nsteps = 1\nsteps = 2\n").message, StartsWith("cfg.toml:3:"));
  CHECK_THAT(failure_of("[train\n").message, Contains("TOML syntax error"));
}

TEST_CASE("config: an integer too large for 64 bits is a syntax error, not a crash",
          "[config][bad-input]") {
  const Failure failure = failure_of("[distributed]\ntp_size = 99999999999999999999\n");
  CHECK_THAT(failure.message, StartsWith("cfg.toml:2:"));
  CHECK_THAT(failure.message, Contains("TOML syntax error"));
  CHECK_THAT(failure.message, Contains("99999999999999999999"));
  CHECK_THAT(failure_of("[train]\nlr = 1e999\n").message, Contains("TOML syntax error"));
}

TEST_CASE("config: random bytes give a clean error", "[config][bad-input]") {
  std::mt19937 random(12345);
  for (int trial = 0; trial < 50; ++trial) {
    std::string bytes(1 + random() % 400, '\0');
    for (auto& byte : bytes) byte = static_cast<char>(random() % 256);
    INFO("trial " << trial);
    CHECK_THROWS_AS(parse(bytes), meshrun::Error);
  }
  CHECK_THAT(failure_of("x = \"\xff\"\n").message, Contains("TOML syntax error"));
}

TEST_CASE("config: load_config reports an unreadable file as NOT_FOUND", "[config][bad-input]") {
  for (const std::string path : {"/nonexistent/meshrun.toml", "/tmp"}) {
    INFO(path);
    try {
      meshrun::load_config(path);
      FAIL("no error");
    } catch (const meshrun::Error& error) {
      CHECK(error.code() == MESHRUN_NOT_FOUND);
      CHECK_THAT(error.what(), StartsWith("cannot read config file '" + path + "': "));
    }
  }
  CHECK_THROWS_WITH(meshrun::load_config("/nonexistent/meshrun.toml"),
                    EndsWith("No such file or directory"));
}

TEST_CASE("config: load_config names the file in positions and errors", "[config]") {
  const TempFolder folder("meshrun-test-config");
  const std::filesystem::path path = folder.file("load.toml");
  std::ofstream(path) << "[distributed]\ntp_size = 2\npp_size = 0\n";
  try {
    meshrun::load_config(path.string());
    FAIL("no error");
  } catch (const meshrun::Error& error) {
    CHECK_THAT(error.what(), StartsWith(path.string() + ":3:1: distributed.pp_size: "));
  }
  std::ofstream(path) << "[distributed]\ntp_size = 2\n";
  const Config config = meshrun::load_config(path.string());
  CHECK(config.source == path.string());
  CHECK(config.where("distributed.tp_size") == path.string() + ":2:1");
}

TEST_CASE("config: unknown key suggests the closest name and lists valid keys",
          "[config][bad-input]") {
  const Failure failure = failure_of("[distributed]\ntp_size = 2\ntp_sise = 2\n");
  CHECK(failure.key == "distributed.tp_sise");
  CHECK_THAT(failure.message, StartsWith("cfg.toml:3:1: unknown key 'distributed.tp_sise' "
                                         "(did you mean 'tp_size'?); valid keys in "
                                         "[distributed]: strategy, dp_size, "));
  CHECK_THAT(failure.message, Contains("zero_dp_strategy"));
  CHECK_THAT(failure_of("[distributed]\npp_schedule = \"gpipe\"\n").message,
             Contains("(it belongs in [distributed.pipeline])"));
  CHECK_THAT(failure_of("[distributed]\ntrain = 1\n").message,
             Contains("(it is a table of its own)"));
}

TEST_CASE("config: unknown tables are named with a suggestion", "[config][bad-input]") {
  CHECK(failure_of("[distributd]\ntp_size = 2\n").message ==
        "cfg.toml:1:2: unknown table 'distributd' (did you mean 'distributed'?); valid tables: "
        "model, data, train, checkpoint, dist_env, comm, distributed");
  CHECK_THAT(
      failure_of("steps = 3\n").message,
      StartsWith("cfg.toml:1:1: unknown key 'steps' (it belongs in [train]); valid tables: "));
  const Failure nested = failure_of("[distributed.pipline]\n");
  CHECK(nested.key == "distributed.pipline");
  CHECK_THAT(nested.message, StartsWith("cfg.toml:1:14: unknown table 'distributed.pipline' "
                                        "(did you mean 'pipeline'?)"));
  CHECK_THAT(failure_of("[distributed.pipeline]\npp_schedle = 'gpipe'\n").message,
             StartsWith("cfg.toml:2:1: unknown key 'distributed.pipeline.pp_schedle' (did you "
                        "mean 'pp_schedule'?); valid keys in [distributed.pipeline]: "));
}

TEST_CASE("config: wrong types name the expected and the given type", "[config][bad-input]") {
  expect_all_rejected({
      {"distributed", "tp_size = \"two\"", "expected an integer >= 1, got a string ('two')"},
      {"distributed", "tp_size = 2.0", "expected an integer >= 1, got a float (2)"},
      {"model", "model_type = true", "got a boolean (true)"},
      {"data", "path = 3", "expected a string, got an integer (3)"},
      {"train", "lr = \"fast\"", "expected a finite number > 0, got a string ('fast')"},
      {"train", "lr = [1]", "got an array ([1])"},
      {"train", "steps = 1979-05-27", "got a date"},
      {"distributed", "pipeline = 3", "expected a table, got an integer (3)"},
  });
  expect_rejected(failure_of("model = 3\n"), "model", "expected a table", "cfg.toml:1:1");
  expect_rejected(failure_of("[[model]]\n"), "model", "got an array", "cfg.toml:1:3");
}

TEST_CASE("config: the first error in file order is reported", "[config][bad-input]") {
  const Failure failure = failure_of("[train]\nwarmup_steps = -1\nsteps = 0\n");
  CHECK(failure.key == "train.warmup_steps");
}

TEST_CASE("config: messages stay on one line whatever the value holds", "[config][bad-input]") {
  const Failure failure = failure_of("[model]\ntorch_dtype = \"a\\nb\"\n");
  CHECK_THAT(failure.message, Contains("got 'a\\nb'"));
  CHECK(failure.message.find('\n') == std::string::npos);
}

TEST_CASE("config rule: parallel sizes are integers >= 1", "[config][rules]") {
  for (const std::string key : {"tp_size", "pp_size", "cp_size", "ep_size", "dp_replicate_size"}) {
    expect_all_rejected({{"distributed", key + " = 0", "expected an integer >= 1, got 0"},
                         {"distributed", key + " = -2", "expected an integer >= 1, got -2"}});
  }
  CHECK(failure_in("distributed", "tp_size = -2").message ==
        "cfg.toml:2:1: distributed.tp_size: expected an integer >= 1, got -2");
}

TEST_CASE("config rule: dp_size is >= 0, where 0 means derived from the world size",
          "[config][rules]") {
  CHECK(parse("[distributed]\ndp_size = 0\n").distributed.dp_size == 0);
  CHECK(parse("[distributed]\ndp_size = 4\n").distributed.dp_size == 4);
  expect_all_rejected({{"distributed", "dp_size = -1", "expected an integer >= 0 (0 or absent"},
                       {"distributed", "dp_size = 1.5", "got a float (1.5)"}});
}

TEST_CASE("config rule: model_type is a plugin name", "[config][rules]") {
  expect_all_rejected({{"model", "model_type = \"Llama 3\"", "[a-z0-9_]+"}});
}

TEST_CASE("config rule: torch_dtype known", "[config][rules]") {
  expect_all_rejected({
      {"model", "torch_dtype = \"bfloat61\"",
       "expected one of 'float32', 'bfloat16', got 'bfloat61' (did you mean 'bfloat16'?)"},
      {"model", "torch_dtype = \"float16\"", "expected one of 'float32', 'bfloat16'"},
  });
}

TEST_CASE("config rule: data.val_fraction is at least 0 and below 1, seq_len >= 1, path non-empty",
          "[config][rules]") {
  CHECK(parse("[data]\nval_fraction = 0\n").data.val_fraction == 0.0);
  expect_all_rejected({
      {"data", "val_fraction = 1", "expected a number in [0, 1), got 1"},
      {"data", "val_fraction = -0.1", "expected a number in [0, 1), got -0.1"},
      {"data", "seq_len = 0", "expected an integer >= 1, got 0"},
      {"data", "path = \"\"", "expected a non-empty path"},
  });
}

TEST_CASE("config rule: train values are in range", "[config][rules]") {
  expect_all_rejected({
      {"train", "steps = 0", "expected an integer >= 1, got 0"},
      {"train", "global_batch_size = 0", "expected an integer >= 1, got 0"},
      {"train", "micro_batch_size = -4", "expected an integer >= 1, got -4"},
      {"train", "lr = -0.001", "expected a finite number > 0, got -0.001"},
      {"train", "lr = 0", "expected a finite number > 0, got 0"},
      {"train", "min_lr = -1e-5", "expected a finite number >= 0, got -1e-05"},
      {"train", "warmup_steps = -1", "expected an integer >= 0, got -1"},
      {"train", "eps = 0", "expected a finite number > 0, got 0"},
      {"train", "weight_decay = -0.1", "expected a finite number >= 0, got -0.1"},
      {"train", "max_grad_norm = -1", "expected a finite number >= 0, got -1"},
      {"train", "seed = -1", "expected an integer >= 0, got -1"},
      {"train", "val_every = -1", "expected an integer >= 0, got -1"},
      {"train", "log_every = 0", "expected an integer >= 1, got 0"},
  });
}

TEST_CASE("config rule: train.min_lr must not exceed train.lr", "[config][rules]") {
  expect_rejected(failure_in("train", "min_lr = 0.1", "lr = 0.01"), "train.min_lr",
                  "train.min_lr (0.1) must be <= train.lr (0.01)");
  expect_rejected(failure_in("train", "lr = 1e-4"), "train.lr",
                  "train.min_lr (0.0003) must be <= train.lr (0.0001)");
}

TEST_CASE("config rule: train.betas is two numbers, each at least 0 and below 1",
          "[config][rules]") {
  const std::string fragment = "expected an array of 2 numbers in [0, 1)";
  expect_all_rejected({
      {"train", "betas = [0.9]", fragment + " ([beta1, beta2]), got an array ([0.9])"},
      {"train", "betas = [0.9, 0.95, 0.99]", fragment},
      {"train", "betas = [0.9, 1.0]", fragment},
      {"train", "betas = [-0.1, 0.9]", fragment},
      {"train", "betas = [0.9, \"x\"]", fragment},
      {"train", "betas = 0.9", fragment + " ([beta1, beta2]), got a float (0.9)"},
  });
}

TEST_CASE("config rule: NaN and infinity are rejected", "[config][rules]") {
  expect_all_rejected({
      {"train", "lr = nan", "expected a finite number > 0, got nan"},
      {"train", "weight_decay = inf", "expected a finite number >= 0, got inf"},
      {"train", "betas = [nan, 0.9]", "expected an array of 2 numbers"},
      {"comm", "timeout_minutes = inf", "got inf"},
      {"data", "val_fraction = nan", "got nan"},
  });
}

TEST_CASE("config rule: checkpoint.save_every >= 0", "[config][rules]") {
  expect_all_rejected({{"checkpoint", "save_every = -5", "expected an integer >= 0, got -5"},
                       {"checkpoint", "export = \"yes\"", "expected a boolean"}});
}

TEST_CASE("config rule: comm.backend is a name and timeout_minutes > 0", "[config][rules]") {
  CHECK(parse("[comm]\nbackend = \"my_backend2\"\n").comm.backend == "my_backend2");
  expect_all_rejected({
      {"comm", "backend = \"NCCL\"", "lowercase letters, digits and '_' ([a-z0-9_]+), got 'NCCL'"},
      {"comm", "backend = \"\"", "got ''"},
      {"comm", "timeout_minutes = 0", "expected a finite number > 0, got 0"},
  });
}

TEST_CASE("config rule: strategy is a name and aliases become megatron_fsdp", "[config][rules]") {
  CHECK(meshrun::canonical_strategy_name("megatron-fsdp") == "megatron_fsdp");
  CHECK(meshrun::canonical_strategy_name("mfsdp") == "megatron_fsdp");
  CHECK(meshrun::canonical_strategy_name("ddp") == "ddp");
  for (const std::string alias : {"megatron-fsdp", "mfsdp", "megatron_fsdp"}) {
    CHECK(parse("[distributed]\nstrategy = \"" + alias + "\"\n").distributed.strategy ==
          "megatron_fsdp");
  }
  CHECK(parse("[distributed]\nstrategy = \"my-strategy_2\"\n").distributed.strategy ==
        "my-strategy_2");
  expect_all_rejected({
      {"distributed", "strategy = \"FSDP2\"", "([a-z0-9_-]+), got 'FSDP2'"},
      {"distributed", "strategy = \"a/b\"", "got 'a/b'"},
      {"distributed", "strategy = 2", "got an integer (2)"},
  });
}

TEST_CASE("config rule: activation_checkpointing is false, true, full or selective",
          "[config][rules]") {
  CHECK(parse("[distributed]\nactivation_checkpointing = true\n")
            .distributed.activation_checkpointing == "full");
  CHECK(parse("[distributed]\nactivation_checkpointing = false\n")
            .distributed.activation_checkpointing.empty());
  CHECK(parse("[distributed]\nactivation_checkpointing = \"selective\"\n")
            .distributed.activation_checkpointing == "selective");
  expect_all_rejected({
      {"distributed", "activation_checkpointing = \"ful\"",
       "expected one of 'full', 'selective', got 'ful' (did you mean 'full'?)"},
      {"distributed", "activation_checkpointing = 1",
       "expected false, true, 'full' or 'selective', got an integer (1)"},
  });
}

TEST_CASE("config rule: reshard_after_forward is unset or a boolean", "[config][rules]") {
  CHECK_FALSE(parse("").distributed.reshard_after_forward.has_value());
  CHECK(parse("[distributed]\nreshard_after_forward = false\n").distributed.reshard_after_forward ==
        std::optional<bool>(false));
  expect_all_rejected({{"distributed", "reshard_after_forward = \"auto\"", "expected a boolean"}});
}

TEST_CASE("config rule: fsdp2 prefetch depths >= 0", "[config][rules]") {
  expect_all_rejected({
      {"distributed", "fsdp2_forward_prefetch_depth = -1", "expected an integer >= 0, got -1"},
      {"distributed", "fsdp2_backward_prefetch_depth = -1", "expected an integer >= 0, got -1"},
  });
}

TEST_CASE("config rule: zero_dp_strategy is 0, 1, 2 or 3", "[config][rules]") {
  CHECK(parse("[distributed]\nstrategy = \"mfsdp\"\nzero_dp_strategy = 3\n")
            .distributed.zero_dp_strategy == 3);
  const std::string rest = "strategy = \"megatron_fsdp\"\n";
  expect_all_rejected({{"distributed", "zero_dp_strategy = 4", "from 0 to 3, got 4"},
                       {"distributed", "zero_dp_strategy = -1", "from 0 to 3, got -1"}},
                      rest);
}

TEST_CASE("config rule: bucket_cap_mb > 0", "[config][rules]") {
  CHECK(parse("[distributed]\nstrategy = \"ddp\"\nbucket_cap_mb = 1\n").distributed.bucket_cap_mb ==
        1.0);
  expect_all_rejected({{"distributed", "bucket_cap_mb = 0", "expected a finite number > 0, got 0"}},
                      "strategy = \"ddp\"\n");
}

TEST_CASE("config rule: pipeline values are in range", "[config][rules]") {
  const std::string rest = "[distributed]\npp_size = 2\n";
  const std::string table = "distributed.pipeline";
  expect_all_rejected(
      {
          {table, "pp_schedule = \"1F1B\"", "([a-z0-9_]+), got '1F1B'"},
          {table, "pp_microbatch_size = 0", "expected an integer >= 1, got 0"},
          {table, "pp_batch_size = 0", "expected an integer >= 1, got 0"},
          {table, "layers_per_stage = 0", "expected an integer >= 1, got 0"},
          {table, "round_virtual_stages_to_pp_multiple = \"upp\"",
           "expected one of 'up', 'down', got 'upp' (did you mean 'up'?)"},
          {table, "module_fqns_per_model_part = [\"a\"]",
           "expected an array of arrays of strings (module names per model part)"},
          {table, "module_fqns_per_model_part = [[\"a\", 1]]", "an array of arrays of strings"},
          {table, "pp_seq_len = -1", "expected an integer >= 0, got -1"},
          {table, "scale_grads_in_schedule = 1", "expected a boolean"},
      },
      rest);
}

TEST_CASE("config rule: pp_batch_size divisible by pp_microbatch_size", "[config][rules]") {
  expect_rejected(failure_in("distributed.pipeline", "pp_batch_size = 6",
                             "pp_microbatch_size = 4\n[distributed]\npp_size = 2\n"),
                  "distributed.pipeline.pp_batch_size",
                  "distributed.pipeline.pp_batch_size (6) must be divisible by "
                  "distributed.pipeline.pp_microbatch_size (4)");
}

TEST_CASE("config rule: strategy-specific keys are accepted only for their strategy",
          "[config][rules]") {
  CHECK(parse("[distributed]\nstatic_graph = true\nstrategy = \"ddp\"\n").distributed.static_graph);
  CHECK_FALSE(parse("[distributed]\nenable_compile = false\n").distributed.enable_compile);
  CHECK(parse("[distributed]\noverlap_grad_reduce = true\nstrategy = \"megatron-fsdp\"\n")
            .distributed.overlap_grad_reduce);
  expect_rejected(failure_in("distributed", "static_graph = true"), "distributed.static_graph",
                  "only valid with strategy 'ddp' (DDPConfig), but distributed.strategy is "
                  "'fsdp2' (the default)");
  expect_rejected(failure_in("distributed", "tp_plan = \"x\"", "strategy = \"ddp\""),
                  "distributed.tp_plan",
                  "only valid with strategy 'fsdp2' (FSDP2Config), but distributed.strategy is "
                  "'ddp'");
  expect_rejected(failure_in("distributed", "zero_dp_strategy = 2"), "distributed.zero_dp_strategy",
                  "only valid with strategy 'megatron_fsdp' (MegatronFSDPConfig)");
  expect_rejected(failure_in("distributed", "enable_compile = true", "strategy = \"my_strategy\""),
                  "distributed.enable_compile", "but distributed.strategy is 'my_strategy'");
}

TEST_CASE("config: [distributed.mp_policy] is FSDP2's MixedPrecisionPolicy", "[config]") {
  const Config defaults = parse("");
  const auto& mp = defaults.distributed.mp_policy;
  CHECK(mp.param_dtype == "bfloat16");
  CHECK(mp.reduce_dtype == "float32");
  CHECK(mp.output_dtype == "float32");
  CHECK(mp.cast_forward_inputs);
  const Config pure = parse("", {"distributed.mp_policy.param_dtype=float32"});
  CHECK(pure.distributed.mp_policy.param_dtype == "float32");
  const Config set =
      parse("[distributed.mp_policy]\nreduce_dtype = \"bfloat16\"\ncast_forward_inputs = false\n");
  CHECK(set.distributed.mp_policy.reduce_dtype == "bfloat16");
  CHECK_FALSE(set.distributed.mp_policy.cast_forward_inputs);
  expect_rejected(failure_in("distributed.mp_policy", "param_dtype = \"float64\""),
                  "distributed.mp_policy.param_dtype", "'float32', 'bfloat16', 'float16'");
  expect_rejected(failure_of("[distributed]\nstrategy = \"ddp\"\n[distributed.mp_policy]\n"
                             "param_dtype = \"float32\"\n"),
                  "distributed.mp_policy", "only valid with strategy 'fsdp2'", "cfg.toml:3:14");
}

TEST_CASE("config rule: sequence_parallel only with fsdp2", "[config][rules]") {
  CHECK(parse("[distributed]\nsequence_parallel = true\ntp_size = 2\n")
            .distributed.sequence_parallel);
  CHECK_FALSE(parse("[distributed]\nsequence_parallel = false\nstrategy = \"ddp\"\n")
                  .distributed.sequence_parallel);
  for (const std::string strategy : {"ddp", "megatron_fsdp"}) {
    expect_rejected(
        failure_in("distributed", "sequence_parallel = true", "strategy = \"" + strategy + "\""),
        "distributed.sequence_parallel",
        "supported only by strategy 'fsdp2', but distributed.strategy is '" + strategy + "'");
  }
}

TEST_CASE("config rule: activation checkpointing with every shipped strategy", "[config][rules]") {
  CHECK(parse("[distributed]\nactivation_checkpointing = false\nstrategy = \"mfsdp\"\n")
            .distributed.activation_checkpointing.empty());
  CHECK(parse("[distributed]\nactivation_checkpointing = \"selective\"\nstrategy = \"mfsdp\"\n")
            .distributed.activation_checkpointing == "selective");
  CHECK(parse("[distributed]\nactivation_checkpointing = true\nstrategy = \"ddp\"\n")
            .distributed.activation_checkpointing == "full");
}

TEST_CASE("config rule: dp_replicate_size > 1 only with fsdp2", "[config][rules]") {
  CHECK(parse("[distributed]\ndp_replicate_size = 2\n").distributed.dp_replicate_size == 2);
  expect_rejected(failure_in("distributed", "dp_replicate_size = 2", "strategy = \"ddp\""),
                  "distributed.dp_replicate_size",
                  "dp_replicate_size 2 > 1 (HSDP) is supported only by strategy 'fsdp2', but "
                  "distributed.strategy is 'ddp'");
}

TEST_CASE("config rule: a pipeline table with pp_size 1 is a warning", "[config][rules]") {
  const Config config = parse("[distributed]\npp_size = 1\n[distributed.pipeline]\n");
  CHECK(config.distributed.pipeline.present);
  REQUIRE(config.warnings.size() == 1);
  CHECK_THAT(config.warnings[0], StartsWith("cfg.toml:3:14: distributed.pipeline: ignored"));
  CHECK_THAT(config.warnings[0], Contains("distributed.pp_size > 1"));
}

TEST_CASE("config rule: pp_size > 1 needs a pipeline table", "[config][rules]") {
  expect_rejected(failure_in("distributed", "pp_size = 2"), "distributed.pp_size",
                  "pp_size 2 > 1 needs a [distributed.pipeline] table; an empty "
                  "[distributed.pipeline] table selects the defaults");
  const Config config = parse("[distributed]\npp_size = 2\n[distributed.pipeline]\n");
  CHECK(config.distributed.pipeline.present);
  CHECK(config.warnings.empty());
}

TEST_CASE("config rule: a moe table needs ep_size > 1", "[config][rules]") {
  expect_rejected(failure_of("[distributed]\ntp_size = 1\n[distributed.moe]\n"), "distributed.moe",
                  "a [distributed.moe] table needs distributed.ep_size > 1 (ep_size is 1)",
                  "cfg.toml:3:14");
  CHECK(parse("[distributed]\nep_size = 2\n[distributed.moe]\n").distributed.moe.present);
}

TEST_CASE("config rule: the comm backend follows dist_env's device", "[config][rules]") {
  CHECK(parse("[dist_env]\nbackend = \"gloo\"\n").comm.backend == "mpi");
  CHECK(parse("[dist_env]\nbackend = \"nccl\"\n").comm.backend == "nccl");
  CHECK(parse("[dist_env]\nbackend = \"nccl\"\n[comm]\nbackend = \"my_nccl\"\n").comm.backend ==
        "my_nccl");
  expect_rejected(failure_of("[dist_env]\nbackend = \"nccl\"\n[comm]\nbackend = \"mpi\"\n"),
                  "comm.backend", "\"mpi\" moves host memory", "cfg.toml:4:1");
  expect_rejected(failure_of("[comm]\nbackend = \"nccl\"\n"), "comm.backend",
                  "set dist_env.backend = \"nccl\" to train on GPUs", "cfg.toml:2:1");
}

// The comm plugins a run joins through are looked for before any rank
// starts: comm.backend's, and on CUDA MPI's, whose world the trainer's host
// memory uses; a missing one names its key, the plugins there are and the
// folders searched.
TEST_CASE("device: a missing comm plugin is refused at its key before any rank starts",
          "[device]") {
  const TempFolder folder("meshrun-test-comm-plugins");
  const meshrun::PluginLoader loader({folder.path()});
  const auto refusal = [&](const Config& config) -> std::pair<std::string, std::string> {
    try {
      meshrun::train::check_comm_plugins(config, loader);
    } catch (const meshrun::Error& error) {
      CHECK(error.is_input_error());
      return {error.key(), error.what()};
    }
    return {};
  };
  const auto [cpu_key, cpu_what] = refusal(parse("[train]\nsteps = 1\n"));
  CHECK(cpu_key == "comm.backend");
  CHECK_THAT(cpu_what, Contains("the ranks join its world: no comm plugin named 'mpi'"));
  CHECK_THAT(cpu_what, Contains(folder.path()));

  const std::string nccl = "[dist_env]\nbackend = \"nccl\"\n";
  std::ofstream(folder.file("meshrun_comm_nccl.so")) << "found, not loaded";
  const auto [cuda_key, cuda_what] = refusal(parse(nccl));
  CHECK(cuda_key == "dist_env.backend");
  CHECK_THAT(cuda_what, StartsWith("cfg.toml:2:1: dist_env.backend: \"nccl\" joins MPI's world"));
  CHECK_THAT(cuda_what, Contains("no comm plugin named 'mpi'; available: nccl"));

  std::ofstream(folder.file("meshrun_comm_mpi.so")) << "found, not loaded";
  CHECK_NOTHROW(meshrun::train::check_comm_plugins(parse(nccl), loader));
  CHECK_NOTHROW(meshrun::train::check_comm_plugins(parse(""), loader));
}

// A rank that cannot have its GPU says which rank, which device and why:
// this build has no GPU trainer (the sanitized build never has), the process
// sees no GPU, or the device is past those it sees.
TEST_CASE("device: a rank that cannot open its GPU names the rank, the device and why",
          "[device]") {
  try {
    meshrun::train::open_rank_gpu(1000, 3);
    FAIL("cuda:1000 opened");
  } catch (const meshrun::Error& error) {
    CHECK(error.code() == MESHRUN_UNAVAILABLE);
    const std::string what = error.what();
    CHECK_THAT(what, StartsWith("rank 3 on cuda:1000: "));
    const bool said_why =
        what.find("libmeshrun_trainer_cuda.so is missing: this build trains on the CPU only") !=
            std::string::npos ||
        what.find("no usable CUDA device") != std::string::npos ||
        what.find("past this process's") != std::string::npos;
    CHECK(said_why);
  }
}

// AutoModel's placement: local rank l on GPU l % the GPUs the process sees.
TEST_CASE("device: a rank's GPU is its local rank modulo the GPUs it sees", "[device]") {
  CHECK(meshrun::gpu_of_local_rank(0, 1) == 0);
  CHECK(meshrun::gpu_of_local_rank(3, 1) == 0);
  CHECK(meshrun::gpu_of_local_rank(3, 8) == 3);
  CHECK(meshrun::gpu_of_local_rank(9, 8) == 1);
  CHECK(meshrun::gpu_of_local_rank(5, 2) == 1);
}

TEST_CASE(
    "device: a CUDA run without a usable GPU, or with more ranks a node than GPUs, is refused",
    "[device]") {
  const meshrun::CudaDevices here = meshrun::cuda_devices();
  CHECK((here.count > 0) == here.why_none.empty());
  const meshrun::CudaDevices none{0, "no NVIDIA driver: libcuda.so.1 cannot be loaded"};
  CHECK_NOTHROW(meshrun::require_usable_devices(parse(""), none));
  const Config cuda = parse("[dist_env]\nbackend = \"nccl\"\n");
  CHECK_NOTHROW(meshrun::require_usable_devices(cuda, {1, ""}));
  CHECK_NOTHROW(meshrun::require_usable_devices(cuda, {2, ""}, 2));
  CHECK_NOTHROW(meshrun::require_usable_devices(parse(""), none, 4));
  try {
    meshrun::require_usable_devices(cuda, {2, ""}, 4);
    FAIL("accepted 4 ranks on 2 GPUs");
  } catch (const meshrun::Error& error) {
    CHECK(error.is_input_error());
    CHECK(error.key() == "--nproc-per-node");
    CHECK_THAT(error.what(), StartsWith("--nproc-per-node: 4 ranks a node, and this machine's "
                                        "processes see 2 CUDA GPUs; dist_env.backend = \"nccl\" "
                                        "(cfg.toml:2:1) needs a GPU of its own"));
  }
  try {
    meshrun::require_usable_devices(cuda, none);
    FAIL("accepted");
  } catch (const meshrun::Error& error) {
    CHECK(error.is_input_error());
    CHECK(error.key() == "dist_env.backend");
    CHECK_THAT(error.what(), StartsWith("cfg.toml:2:1: dist_env.backend: \"nccl\" puts every rank "
                                        "on a CUDA GPU, and this machine has none usable (no "
                                        "NVIDIA driver"));
  }
}

TEST_CASE("config override: values are read as TOML", "[config][override]") {
  const Config config =
      parse("", {"distributed.tp_size=2", "model.tie_word_embeddings=true",
                 "train.betas=[0.9,0.99]", "train.lr=0.01", "dist_env.backend=\"nccl\"",
                 "distributed.reshard_after_forward=false"});
  CHECK(config.distributed.tp_size == 2);
  CHECK(config.model.architecture.at("tie_word_embeddings") == true);
  CHECK(config.train.beta2 == 0.99);
  CHECK(config.train.lr == 0.01);
  CHECK(config.comm.backend == "nccl");
  CHECK(config.distributed.reshard_after_forward == std::optional<bool>(false));
}

TEST_CASE("config override: a value that is not TOML is a bare string", "[config][override]") {
  const Config config =
      parse("", {"distributed.strategy=ddp", "data.path=/tmp/some file.txt",
                 "distributed.pipeline.pp_schedule=1f1b", "distributed.pp_size=2"});
  CHECK(config.distributed.strategy == "ddp");
  CHECK(config.data.path == "/tmp/some file.txt");
  CHECK(config.distributed.pipeline.pp_schedule == "1f1b");
  CHECK(parse("", {"model.checkpoint=a=b"}).model.checkpoint == "a=b");
}

TEST_CASE("config override: replaces file values and records its position", "[config][override]") {
  const Config config = parse("[distributed]\ntp_size = 4\n", {"distributed.tp_size=2"});
  CHECK(config.distributed.tp_size == 2);
  CHECK(config.where("distributed.tp_size") == "override 'distributed.tp_size=2'");
  CHECK(config.where("distributed") == "cfg.toml:1:2");
  CHECK(parse("", {"train.steps=3", "train.steps=5"}).train.steps == 5);
}

TEST_CASE("config override: may create tables", "[config][override]") {
  const Config config = parse("", {"distributed.pipeline.pp_schedule=gpipe"});
  CHECK(config.distributed.pipeline.present);
  CHECK(config.distributed.pipeline.pp_schedule == "gpipe");
  CHECK(config.where("distributed.pipeline") ==
        "override 'distributed.pipeline.pp_schedule=gpipe'");
  CHECK(config.warnings.size() == 1);
  CHECK(parse("", {"distributed.moe={}", "distributed.ep_size=2"}).distributed.moe.present);
  CHECK(parse("[distributed]\npp_size = 2\n", {"distributed.pipeline={}"})
            .distributed.pipeline.present);
}

TEST_CASE("config override: validated like file keys", "[config][override]") {
  expect_rejected(failure_of("", {"distributed.tp_size=-2"}), "distributed.tp_size",
                  "expected an integer >= 1, got -2", "override 'distributed.tp_size=-2'");
  const Failure unknown = failure_of("", {"distributed.tp_sise=2"});
  CHECK(unknown.key == "distributed.tp_sise");
  CHECK_THAT(unknown.message, StartsWith("override 'distributed.tp_sise=2': unknown key "
                                         "'distributed.tp_sise' (did you mean 'tp_size'?)"));
  expect_rejected(failure_of("", {"distributed.tp_size=two"}), "distributed.tp_size",
                  "got a string ('two')", "override 'distributed.tp_size=two'");
  const Failure overflow = failure_of("", {"distributed.tp_size=99999999999999999999"});
  CHECK_THAT(overflow.message, Contains("expected an integer >= 1, got a string "
                                        "('99999999999999999999'); the override value was "
                                        "read as a string because it is not a TOML value"));
  CHECK_THAT(overflow.message, Contains("not representable in 64 bits"));
  expect_rejected(failure_of("", {"distributed.static_graph=true"}), "distributed.static_graph",
                  "only valid with strategy 'ddp'", "override 'distributed.static_graph=true'");
  expect_rejected(failure_of("", {"distributed.pp_size=2"}), "distributed.pp_size",
                  "needs a [distributed.pipeline] table", "override 'distributed.pp_size=2'");
  CHECK_THAT(failure_of("", {"foo.bar=1"}).message,
             StartsWith("override 'foo.bar=1': unknown table 'foo'"));
  expect_rejected(failure_of("", {"train.steps=1\nx=2"}), "train.steps", "got a string ('1\\nx=2')",
                  "override 'train.steps=1\\nx=2'");
}

TEST_CASE("config override: malformed overrides are errors naming them", "[config][override]") {
  for (const std::string bad :
       {"distributed.tp_size", "=2", "distributed..tp_size=2", ".tp_size=2", "distributed.=2"}) {
    INFO(bad);
    const Failure failure = failure_of("", {bad});
    CHECK(failure.code == MESHRUN_INVALID_ARGUMENT);
    CHECK_THAT(failure.message, StartsWith("override '" + bad + "': malformed override ("));
    CHECK_THAT(failure.message, Contains("expected key.path=value"));
  }
}

TEST_CASE("config override: cannot descend into a value that is not a table",
          "[config][override]") {
  expect_rejected(failure_of("[model]\nhidden_size = 64\n", {"model.hidden_size.x=1"}),
                  "model.hidden_size", "expected a table, got an integer (64)",
                  "override 'model.hidden_size.x=1'");
}

TEST_CASE("config: every example in examples/ parses", "[config][examples]") {
  int count = 0;
  for (const auto& file : std::filesystem::directory_iterator(MESHRUN_SOURCE_DIR "/examples")) {
    if (file.path().extension() != ".toml") continue;
    INFO(file.path().string());
    const Config config = meshrun::load_config(file.path().string());
    CHECK(config.warnings.empty());
    ++count;
  }
  CHECK(count >= 5);
  const Config tiny = meshrun::load_config(MESHRUN_SOURCE_DIR "/examples/llama-tiny.toml");
  CHECK(tiny.distributed.strategy == "fsdp2");
  CHECK(tiny.model.architecture.at("num_key_value_heads") == 4);
  CHECK(tiny.data.path == "/usr/share/common-licenses/GPL-3");
  const Config hsdp = meshrun::load_config(MESHRUN_SOURCE_DIR "/examples/fsdp2-hsdp.toml");
  CHECK(hsdp.distributed.dp_replicate_size == 2);
  CHECK(hsdp.distributed.tp_size == 2);
  CHECK(hsdp.distributed.mp_policy.param_dtype == "bfloat16");
  CHECK(hsdp.positions.count("distributed.mp_policy.cast_forward_inputs") == 1);
  const Config pipeline = meshrun::load_config(MESHRUN_SOURCE_DIR "/examples/pipeline-1f1b.toml");
  CHECK(pipeline.distributed.pp_size == 2);
  CHECK(pipeline.distributed.pipeline.present);
  const Config mfsdp = meshrun::load_config(MESHRUN_SOURCE_DIR "/examples/megatron-fsdp.toml");
  CHECK(mfsdp.distributed.strategy == "megatron_fsdp");
  const Config moe = meshrun::load_config(MESHRUN_SOURCE_DIR "/examples/moe-ep.toml");
  CHECK(moe.distributed.ep_size == 2);
  CHECK(moe.distributed.moe.present);
}

TEST_CASE("config: nesting and key length are bounded before toml++ reads the text",
          "[config][bad-input]") {
  // toml++ destroys tables recursively: 100,000 levels overflowed the stack.
  std::string deep = "a";
  for (int level = 1; level < 100000; ++level) deep += ".a";
  CHECK_THAT(
      failure_of(deep + " = 1\n").message,
      StartsWith("cfg.toml:1:64: 'a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a."
                 "...': nested more than 32 levels deep"));
  CHECK_THAT(failure_of("[" + deep + "]\n").message,
             StartsWith("cfg.toml:1:33: '[a.a.a") && Contains("nested more than 32 levels deep"));
  CHECK_THAT(failure_of("[model]\n" + deep + " = 2\nx = ]").message,
             StartsWith("cfg.toml:2:") && Contains("nested more than 32 levels deep"));
  CHECK_THAT(failure_of("x = [{a = [{b = {" + deep + " = 1}}]}]\n").message,
             Contains("nested more"));
  // A quoted key's dots and brackets, strings and comments count for nothing.
  const std::string quoted_dots = std::string(200, '.');
  CHECK_NOTHROW(parse("[model]\n'" + quoted_dots + "' = \"" + deep.substr(0, 200) + "[[[\" # ." +
                      deep.substr(0, 200) + "\n"));

  // An 8 MiB key took a minute: the closest valid key is an edit distance.
  CHECK_THAT(failure_of(std::string(8 << 20, 'k') + " = 1\n").message,
             StartsWith("cfg.toml:1:257: a key longer than 256 bytes ('kkkk"));
  CHECK_THAT(failure_of("[\"" + std::string(300, 'k') + "\"]\n").message,
             Contains("a key longer than 256 bytes"));
  CHECK_NOTHROW(parse("[model]\n" + std::string(256, 'k') + " = 1\n"));

  CHECK_THAT(failure_of("", {deep.substr(0, 99) + "=1"}).message, Contains("more than 32 parts"));
  CHECK_THAT(failure_of("", {std::string(257, 'k') + "=1"}).message,
             Contains("a key part longer than 256 bytes"));
  CHECK_THAT(failure_of("", {"model.x={" + deep.substr(0, 99) + "=1}"}).message,
             StartsWith("override 'model.x={a.a.a") && Contains("nested more than 32"));
}
