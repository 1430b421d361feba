// Expert parallelism: the experts of a mixture-of-experts layer spread over
// the ep ranks of a stage (meshrun/model.h, meshrun_model_stage_setup.ep).
// Expert e of E lives on ep rank e * ep / E; a rank sends each of its rows
// to the ranks of the experts the router picked for it (dispatch), the
// experts compute on the rows they received, and the results travel back
// (combine): two all-to-alls with per-rank counts each way.
#pragma once

#include <cstdint>
#include <vector>

#include "common/compute.hpp"

namespace meshrun::models {

// The ranks experts are spread over.
class ExpertParallelGroup {
 public:
  virtual ~ExpertParallelGroup() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // Every rank sends send_counts[r] floats to rank r, the blocks one after
  // another in `send` in rank order, and receives recv_counts[r] floats
  // from rank r into `recv`, likewise; both in the stage's compute's
  // memory. Returns when both are done.
  virtual void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                          const std::vector<int64_t>& recv_counts) = 0;
};

// The group of one rank: every expert is local; its all-to-all is a copy
// on `compute` (which must outlive it).
class SingleExpertRank : public ExpertParallelGroup {
 public:
  explicit SingleExpertRank(Compute& compute = host_compute()) : compute_(compute) {}
  int64_t size() const override { return 1; }
  int64_t rank() const override { return 0; }
  void all_to_all(const float* send, const std::vector<int64_t>& send_counts, float* recv,
                  const std::vector<int64_t>& recv_counts) override;

 private:
  Compute& compute_;
};

// What a stage's MoE layers add up over its forwards: the micro-batches'
// router auxiliary losses (each the mean over the stage's layers of theirs,
// weighted by layers / model layers so that stages add up to the model's)
// and the tokens routed to each expert.
struct ExpertStatistics {
  double aux_loss = 0;
  std::vector<double> expert_tokens;  // per expert, summed over layers and top-k slots
};

// Where a stage's experts are: over `group` (one rank when null), expert e
// of `experts` on rank e * size / experts. `statistics`, when set, receives
// what the layers add up.
struct ExpertParallel {
  ExpertParallelGroup* group = nullptr;
  ExpertStatistics* statistics = nullptr;
  int64_t size() const { return group != nullptr ? group->size() : 1; }
  int64_t rank() const { return group != nullptr ? group->rank() : 0; }
  int64_t owner(int64_t expert, int64_t experts) const { return expert * size() / experts; }
  bool holds(int64_t expert, int64_t experts) const {
    return expert < 0 || owner(expert, experts) == rank();
  }
};

}  // namespace meshrun::models
