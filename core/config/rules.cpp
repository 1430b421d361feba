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
  if (!d.activation_checkpointing.empty() && d.strategy == "megatron_fsdp") {
    fail_rule(config, {"distributed.activation_checkpointing"},
              "strategy 'megatron_fsdp' has no activation checkpointing (MegatronFSDPConfig); "
              "remove the key or set it to false");
  }
  if (d.dp_replicate_size > 1 && d.strategy != "fsdp2") {
    fail_rule(config, {"distributed.dp_replicate_size"},
              fmt::format("dp_replicate_size {} > 1 (HSDP) is supported only by strategy "
                          "'fsdp2', but distributed.strategy is {}",
                          d.dp_replicate_size, strategy_text(config)));
  }
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

}  // namespace

void check_cross_key_rules(Config& config) {
  check_train(config);
  check_pipeline(config);
  check_strategy_keys(config);
  check_strategy_features(config);
  check_parallel_tables(config);
}

}  // namespace meshrun::config_detail
