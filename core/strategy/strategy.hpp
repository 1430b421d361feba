// The core's side of the strategy ABI (meshrun/strategy.h): a loaded
// strategy plugin instance, set up over the host's flat parameter and
// gradient buffers, driven at module boundaries by the trainer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "meshrun/strategy.h"
#include "plugin/loader.hpp"

namespace meshrun {

// The host's view of what the strategy works on. The buffers, and the
// data-parallel communicator handed to the Strategy, must outlive it. Null
// buffers with numel > 0 ask a strategy that takes weights by shard to
// start from zero: the host then writes the initial values into
// local_shard() itself.
//
// On a GPU (`device` kDLCUDA, the comm backend's device type) the buffers
// and every view the strategy lends are device memory, and the strategy
// orders its work against the host's `compute_stream` and the
// communicators' `comm_stream` (meshrun/strategy.h, ABI 1.13).
struct StrategyBuffers {
  float* parameters = nullptr;
  float* gradients = nullptr;
  int64_t numel = 0;
  std::vector<int64_t> parameter_offsets;  // num_parameters + 1 entries
  std::vector<std::string> parameter_names;
  DLDevice device = {kDLCPU, 0};
  void* compute_stream = nullptr;  // cudaStream_t; NULL: the default stream
  void* comm_stream = nullptr;
};

// What a sharded strategy (ABI 1.3) also needs: the shard and replicate
// groups and the units. A sharded strategy copies its shard out of
// StrategyBuffers::parameters during construction; the host may then free
// its buffers.
struct StrategyUnits {
  Communicator* shard_group = nullptr;      // dp_shard_cp
  Communicator* replicate_group = nullptr;  // dp_replicate
  int32_t num_units = 0;
  int32_t root_unit = 0;
  std::vector<int32_t> parameter_units;  // one per parameter
  std::vector<int64_t> parameter_rows;   // dim 0 of each parameter
};

// A flat float32 view a sharded strategy owns.
struct FloatView {
  float* data = nullptr;
  int64_t numel = 0;
};

// The same for bfloat16 elements.
struct Bfloat16View {
  const uint16_t* data = nullptr;
  int64_t numel = 0;
};

// The strategy's memory, for metrics.jsonl's "mem".
struct StrategyMemory {
  int64_t buffers = 0;
  int64_t buffers_peak = 0;
  int64_t buffers_reserved = 0;  // buffers plus what is kept for reuse
};

// True when `library` is a strategy whose table has every training entry
// point of ABI 1.2 and, when it is sharded, of ABI 1.3 (a third-party
// strategy may ship mesh rules only).
bool strategy_can_train(const PluginLibrary& library);
// Whether the library's strategy shards parameters (a sharded ABI 1.3 table).
bool strategy_shards(const PluginLibrary& library);
// Whether the library's strategy starts its shards without the whole model
// (ABI 1.6 weights_by_shard): see StrategyBuffers.
bool strategy_takes_weights_by_shard(const PluginLibrary& library);

// A strategy's prediction of one rank's memory (meshrun_strategy_memory_plan).
struct StrategyMemoryPlan {
  int64_t local_numel = 0;   // float32 parameters the rank's optimizer updates
  int64_t buffers_held = 0;  // bytes held between steps
};

// What `library` predicts for parameters laid out as `layout` says (its
// buffers unused) in `units` (groups unused), sharded over `shard_ranks`
// with `replicate_ranks` replicas (ABI 1.6 plan_memory). Without
// plan_memory: every parameter for a replicated strategy, nothing known
// (nullopt) for a sharded one. Throws the plugin's errors.
std::optional<StrategyMemoryPlan> plan_strategy_memory(std::shared_ptr<PluginLibrary> library,
                                                       const StrategyBuffers& layout,
                                                       const StrategyUnits& units,
                                                       int64_t shard_ranks, int64_t replicate_ranks,
                                                       const std::string& options_json);

// The [distributed] keys a strategy plugin reads, as AutoModel names them
// (DDPConfig, FSDP2Config or MegatronFSDPConfig): the JSON object of its setup's options_json.
std::string strategy_options_json(const DistributedConfig& distributed);

class Strategy {
 public:
  // Creates an instance of `library` (a strategy plugin) and sets it up.
  // Throws UNIMPLEMENTED naming the plugin file when its table lacks the
  // training entry points; otherwise the plugin's own errors. `units` is
  // required by a sharded strategy (INVALID_ARGUMENT without) and ignored
  // by others.
  Strategy(std::shared_ptr<PluginLibrary> library, Communicator& data_parallel,
           StrategyBuffers buffers, const std::string& options_json,
           const StrategyUnits* units = nullptr);

  // True when the plugin's table has the ABI 1.3 sharded entry points.
  bool sharded() const;

  void broadcast_parameters();
  void begin_micro_batch(bool sync);
  // The gradients of elements [begin, end) are final for this backward.
  void gradients_ready(int64_t begin, int64_t end);
  void finish_gradients();
  StrategyMemory memory();

  // Sharded strategies only (UNIMPLEMENTED otherwise); see meshrun/strategy.h.
  void pre_forward(int32_t unit);
  void post_forward(int32_t unit);
  void pre_backward(int32_t unit);
  void post_backward(int32_t unit);
  // The unit's full parameters and (in its backward, else data null) gradients.
  std::pair<FloatView, FloatView> unit_views(int32_t unit);
  // The unit's full parameters as the strategy gathered them in bfloat16
  // (ABI 1.12); data null when it holds none or its table predates 1.12.
  Bfloat16View unit_views_bfloat16(int32_t unit);
  // This rank's shard of the parameters and their gradients.
  std::pair<FloatView, FloatView> local_shard();
  std::vector<meshrun_shard_segment> shard_segments();
  // Fills `full` (every parameter element) on every rank; collective.
  void gather_parameters(float* full, int64_t numel);

  const PluginLibrary& library() const { return instance_.library(); }

 private:
  const meshrun_strategy_api& api() const { return *instance_.library().api().strategy; }
  // Calls `entry_point` through `body`, which returns the plugin's error, in
  // a PluginCallScope; throws that error, if any, naming the strategy and
  // `entry_point`.
  template <class Call>
  void call(const char* entry_point, Call&& body) const;

  // The view `tensor`, the `what` ("parameters" or "gradients") view that
  // `where` (e.g. "unit_views(unit 3)") handed back, once it is a flat
  // float32 host view; empty when its data is NULL and `may_be_null`.
  // Throws INTERNAL naming the first property that fails.
  FloatView float_view(const DLTensor& tensor, const std::string& where, const char* what,
                       bool may_be_null) const;
  // The same for a view of `dtype` (named `dtype_name` in messages).
  std::pair<void*, int64_t> flat_view(const DLTensor& tensor, const std::string& where,
                                      const char* what, bool may_be_null, DLDataType dtype,
                                      const char* dtype_name) const;
  // The number of elements of `unit`'s views; INTERNAL naming `where` for a
  // unit out of range.
  int64_t unit_numel(int32_t unit, const std::string& where) const;
  // Throws INTERNAL unless a view of `view_numel` elements has `numel`;
  // `expected` says where that number comes from.
  void check_length(int64_t view_numel, int64_t numel, const std::string& where, const char* what,
                    const char* expected) const;
  // MESHRUN_INITIAL_WEIGHTS_BY_SHARD, once the plugin is known to take it;
  // INVALID_ARGUMENT naming the plugin otherwise.
  int32_t by_shard_weights() const;
  // Checks `units` and points setup's ABI 1.3 fields at a copy of them.
  void fill_units(meshrun_strategy_setup& setup, const StrategyUnits* units);
  // Throws UNIMPLEMENTED naming `entry_point` unless the strategy is sharded.
  void require_sharded(const char* entry_point) const;

  // What setup points to stays valid until the instance is destroyed, so
  // the instance is declared last: destroyed first.
  StrategyBuffers buffers_;
  StrategyUnits units_;
  std::vector<int64_t> unit_numel_;  // parameter elements of each unit
  std::vector<bool> in_backward_;    // of each unit: from pre_backward to post_backward
  std::vector<const char*> name_pointers_;
  std::string options_json_;
  PluginInstance instance_;
};

}  // namespace meshrun
