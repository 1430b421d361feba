#include "options.hpp"

#include <string>

#include "common/options.hpp"

namespace meshrun::fsdp2 {

using strategies::dtype_from_name;
using strategies::dtype_name;
using strategies::dtype_names;

sharding::EngineOptions parse_options(const char* options_json) {
  const strategies::Json json = strategies::parse_options(options_json);
  const strategies::OptionReader options(json);
  sharding::EngineOptions parsed;
  parsed.pp_size = options.integer("pp_size", parsed.pp_size, 1);
  parsed.reshard_after_forward = options.optional_boolean("reshard_after_forward");
  parsed.defer_grad_sync = options.boolean("defer_fsdp_grad_sync", parsed.defer_grad_sync);
  parsed.prefetch = options.boolean("enable_fsdp2_prefetch", parsed.prefetch);
  parsed.forward_prefetch_depth =
      options.integer("fsdp2_forward_prefetch_depth", parsed.forward_prefetch_depth, 0);
  parsed.backward_prefetch_depth =
      options.integer("fsdp2_backward_prefetch_depth", parsed.backward_prefetch_depth, 0);

  const strategies::OptionReader mp_policy = options.object("mp_policy");
  parsed.param_dtype = dtype_from_name(
      mp_policy.choice("param_dtype", dtype_name(parsed.param_dtype), dtype_names()));
  parsed.reduce_dtype = dtype_from_name(
      mp_policy.choice("reduce_dtype", dtype_name(parsed.reduce_dtype), dtype_names()));
  mp_policy.choice("output_dtype", "float32", dtype_names());
  mp_policy.boolean("cast_forward_inputs", true);
  return parsed;
}

}  // namespace meshrun::fsdp2
