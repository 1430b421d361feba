#include "options.hpp"

#include "common/errors.hpp"
#include "common/options.hpp"

namespace meshrun::megatron_fsdp {

sharding::EngineOptions parse_options(const char* options_json) {
  const strategies::Json json = strategies::parse_options(options_json);
  const strategies::OptionReader options(json);
  const int64_t zero = options.integer("zero_dp_strategy", 3, 0);
  if (zero > 3) {
    strategies::invalid("option zero_dp_strategy: " + std::to_string(zero) +
                        " is not 0, 1, 2 or 3");
  }
  // ZeRO-0 and -1 reduce whole gradients once per step: at level 0 over a
  // shard group of one (the host's mesh replicates over dp), so that every
  // rank keeps everything.
  sharding::EngineOptions parsed;
  parsed.keep_parameters_gathered = zero < 3;
  parsed.defer_grad_sync = zero <= 1;
  parsed.overlap_grad_reduce = options.boolean("overlap_grad_reduce", true);
  parsed.prefetch = options.boolean("overlap_param_gather", true);
  parsed.double_buffer = options.boolean("fsdp_double_buffer", false);
  parsed.single_bucket = options.boolean("disable_bucketing", false);
  parsed.forward_prefetch_depth = 1;
  parsed.backward_prefetch_depth = 1;
  parsed.average_in_collective = options.boolean("average_in_collective", false);
  parsed.report_nan_in_param_grad = options.boolean("report_nan_in_param_grad", false);
  parsed.param_dtype = strategies::Dtype::float32;
  parsed.reduce_dtype = strategies::Dtype::float32;
  return parsed;
}

bool checks_for_nan_in_grad(const char* options_json) {
  const strategies::Json json = strategies::parse_options(options_json);
  return strategies::OptionReader(json).boolean("check_for_nan_in_grad", false);
}

}  // namespace meshrun::megatron_fsdp
