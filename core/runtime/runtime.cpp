#include "runtime/runtime.hpp"

#include <fmt/format.h>

#include "errors.hpp"

namespace meshrun {

Runtime::Runtime(std::string toml_text, std::string source_name)
    : text_(std::move(toml_text)),
      source_(std::move(source_name)),
      config_(parse_config(text_, source_)),
      loader_(PluginLoader::from_environment()) {}

void Runtime::apply_override(const std::string& assignment) {
  if (plan_) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "override '" + assignment + "': the mesh is already built; overrides come first");
  }
  auto overrides = overrides_;
  overrides.push_back(assignment);
  config_ = parse_config(text_, source_, overrides);
  overrides_ = std::move(overrides);
}

void Runtime::build_mesh(int64_t world_size, int64_t rank) {
  if (plan_) throw Error(MESHRUN_FAILED_PRECONDITION, "the mesh is already built");
  if (world_size < 1) {
    throw invalid_argument(fmt::format("world_size must be >= 1, got {}", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw Error(MESHRUN_OUT_OF_RANGE, fmt::format("rank {} is outside [0, {}) for world_size {}",
                                                  rank, world_size, world_size));
  }
  plan_ = make_plan(config_, world_size, loader_, names_a_model());
  rank_ = rank;
}

void Runtime::join() {
  if (plan_) throw Error(MESHRUN_FAILED_PRECONDITION, "the mesh is already built");
  auto job = std::make_shared<Job>(config_, loader_);
  Plan plan = make_plan(config_, job->world().size(), loader_, names_a_model());
  job->split_axes(plan.mesh);
  rank_ = job->world().rank();
  plan_ = std::move(plan);
  job_ = std::move(job);
}

// A host program that computes its own model plans none: only a config with
// a [model] table names one.
bool Runtime::names_a_model() const { return config_.positions.count("model") > 0; }

const std::shared_ptr<Job>& Runtime::job() const {
  if (!job_) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "the runtime has not joined a job: call meshrun_runtime_join first");
  }
  return job_;
}

const Plan& Runtime::plan() const {
  if (!plan_) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "the mesh is not built yet: call meshrun_runtime_build_mesh first");
  }
  return *plan_;
}

}  // namespace meshrun
