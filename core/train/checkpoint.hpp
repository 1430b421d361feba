// Checkpoints of a run (DESIGN.md "Run output directory"):
// - consolidated: DIR/model.safetensors with Hugging Face names and shapes
//   and DIR/config.json (a Hugging Face LlamaConfig), read back by
//   model.checkpoint = "DIR";
// - sharded, for resuming: DIR/checkpoints/step_N/, where rank r of W wrote
//   shard_r.safetensors holding its slice [r*n/W, (r+1)*n/W) of the flat
//   parameters and of AdamW's two moments, and rank 0 wrote index.json last.
//   Any world size reads it: a rank reads the slices overlapping the range
//   it needs (the whole buffer while DDP replicates everything).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "llama/model.hpp"

namespace meshrun::train {

// The Llama architecture of the config as the model takes it.
llama::LlamaConfig llama_config(const ModelConfig& model);

// Hugging Face's config.json for the [model] table.
nlohmann::ordered_json hf_config_json(const ModelConfig& model);

void export_consolidated(const std::string& dir, const ModelConfig& config,
                         const llama::LlamaModel& model);

// Checks model.checkpoint's names and shapes against `model`; with `load`
// also copies the weights in. Errors name model.checkpoint.
void read_consolidated(const Config& config, llama::LlamaModel& model, bool load);

// One flat buffer a sharded checkpoint holds ("params", "exp_avg", ...).
struct FlatBuffer {
  std::string name;
  float* data = nullptr;
};

// What index.json says.
struct CheckpointIndex {
  std::string dir;
  int64_t step = 0;  // optimizer steps taken; the run resumes at this step
  int64_t world_size = 0;
  int64_t numel = 0;
  struct Slice {
    std::string file;
    int64_t begin = 0, end = 0;
  };
  std::vector<Slice> slices;
};

// Collective over `world`: every rank writes its slice of `buffers` (numel
// elements each), then rank 0 writes index.json.
void save_sharded(const std::string& dir, const Config& config, int64_t step, int64_t numel,
                  const std::vector<FlatBuffer>& buffers, Communicator& world);

// Reads and checks checkpoint.resume_from's index.json against the config
// (architecture, seed, number of steps) and `numel`. Errors name
// checkpoint.resume_from.
CheckpointIndex read_index(const Config& config, int64_t numel);

// Fills elements [begin, end) of every buffer from the slices overlapping it.
void load_sharded(const CheckpointIndex& index, int64_t begin, int64_t end,
                  const std::vector<FlatBuffer>& buffers);

}  // namespace meshrun::train
