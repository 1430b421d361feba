// The core's side of the strategy ABI (meshrun/strategy.h): a loaded
// strategy plugin instance, set up over the host's flat parameter and
// gradient buffers, driven at module boundaries by the trainer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "meshrun/strategy.h"
#include "plugin/loader.hpp"

namespace meshrun {

// The host's view of what the strategy works on. The buffers, and the
// data-parallel communicator handed to the Strategy, must outlive it.
struct StrategyBuffers {
  float* parameters = nullptr;
  float* gradients = nullptr;
  int64_t numel = 0;
  std::vector<int64_t> parameter_offsets;  // num_parameters + 1 entries
  std::vector<std::string> parameter_names;
};

// True when `library` is a strategy whose table has every training entry
// point of ABI 1.2 (fsdp2 and megatron_fsdp still ship mesh rules only).
bool strategy_can_train(const PluginLibrary& library);

class Strategy {
 public:
  // Creates an instance of `library` (a strategy plugin) and sets it up.
  // Throws UNIMPLEMENTED naming the plugin file when its table lacks the
  // ABI 1.2 training entry points; otherwise the plugin's own errors.
  Strategy(std::shared_ptr<PluginLibrary> library, Communicator& data_parallel,
           StrategyBuffers buffers, const std::string& options_json);

  void broadcast_parameters();
  void begin_micro_batch(bool sync);
  // The gradients of elements [begin, end) are final for this backward.
  void gradients_ready(int64_t begin, int64_t end);
  void finish_gradients();
  int64_t buffer_bytes();

  const PluginLibrary& library() const { return instance_.library(); }

 private:
  const meshrun_strategy_api& api() const { return *instance_.library().api().strategy; }
  // Throws the plugin's error, if any, naming the strategy and `entry_point`.
  void call(meshrun_error* error, const char* entry_point) const;

  // What setup points to stays valid until the instance is destroyed, so
  // the instance is declared last: destroyed first.
  StrategyBuffers buffers_;
  std::vector<const char*> name_pointers_;
  std::string options_json_;
  PluginInstance instance_;
};

}  // namespace meshrun
