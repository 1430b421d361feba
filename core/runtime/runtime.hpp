// A run's lifecycle as the host API sees it: created (config parsed and
// validated) -> mesh built (plugins loaded, plan made) for any world size,
// or joined as one rank of a running job (the mesh built for the job's
// world, communicators made). Calls made in the wrong state throw
// FAILED_PRECONDITION.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "plan/plan.hpp"
#include "plugin/loader.hpp"
#include "runtime/job.hpp"

namespace meshrun {

class Runtime {
 public:
  Runtime(std::string toml_text, std::string source_name);

  // Re-validates the config with one more "key.path=value" override; the
  // runtime is unchanged when it throws.
  void apply_override(const std::string& assignment);
  void build_mesh(int64_t world_size, int64_t rank);
  // Joins the running job (collective over it) and builds its mesh.
  void join();

  const Config& config() const { return config_; }
  bool mesh_built() const { return plan_.has_value(); }
  const Plan& plan() const;
  const MeshContext& mesh() const { return plan().mesh; }
  int64_t rank() const { return rank_; }
  // The joined job, shared with what is made from it; FAILED_PRECONDITION
  // before join.
  const std::shared_ptr<Job>& job() const;

 private:
  bool names_a_model() const;

  std::string text_;
  std::string source_;
  std::vector<std::string> overrides_;
  Config config_;
  PluginLoader loader_;
  std::optional<Plan> plan_;
  int64_t rank_ = 0;
  std::shared_ptr<Job> job_;
};

}  // namespace meshrun
