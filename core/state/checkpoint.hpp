// Checkpoints of a run (docs/design.md, "Output directory"; the format in
// docs/checkpoints.md):
// - consolidated: DIR/model.safetensors with Hugging Face names and shapes
//   and DIR/config.json (the model plugin's Hugging Face config), read back
//   by model.checkpoint = "DIR";
// - sharded, for resuming: DIR/checkpoints/step_N/, where every rank wrote
//   shard_r.safetensors holding ranges of the flat parameters and of
//   AdamW's two moments (a DDP rank its 1/W of the buffer, an FSDP2 rank
//   the pieces of its shard), and rank 0 wrote index.json last, mapping
//   every range to its file and recording each file's size and checksum.
//   A step is written into step_N.partial/, fsynced and renamed into place,
//   so it is complete or absent. Any world size and strategy reads it: a
//   rank reads the slices overlapping the ranges it holds.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/model.hpp"

namespace meshrun {

// Hugging Face's config.json: the model's, with the storage dtype.
nlohmann::ordered_json hf_config_json(const ModelConfig& config,
                                      const ModelDescription& description);

// Writes model.safetensors (the description's names and shapes, values from
// the flat `parameters`) and config.json into `dir`.
void export_consolidated(const std::string& dir, const ModelConfig& config,
                         const ModelDescription& description, const float* parameters);

class SafetensorsFile;

// model.checkpoint's weights, read one parameter at a time. Opening checks
// the names and shapes against the description (errors name
// model.checkpoint); read refuses a value that is not finite.
class ConsolidatedWeights {
 public:
  ConsolidatedWeights(const Config& config, const ModelDescription& description);
  ~ConsolidatedWeights();
  // Fills `values` (parameter.numel elements) with the parameter's weights.
  void read(const ModelParameter& parameter, float* values) const;

 private:
  std::string path_;
  std::unique_ptr<SafetensorsFile> file_;
};

// Checks model.checkpoint's names and shapes against the description; with
// `parameters` (the flat layout) also copies the weights in. Errors name
// model.checkpoint.
void read_consolidated(const Config& config, const ModelDescription& description,
                       float* parameters = nullptr);

// One flat buffer a sharded checkpoint holds ("params", "exp_avg", ...), in
// the rank's local layout.
struct FlatBuffer {
  std::string name;
  float* data = nullptr;
};

// Elements [global_begin, global_begin + count) of the flat parameter layout
// held at [local_begin, local_begin + count) of a rank's local buffers.
struct HeldRange {
  int64_t global_begin = 0;
  int64_t local_begin = 0;
  int64_t count = 0;
};

// What a sharded checkpoint is of: the elements of the flat layout and a
// hash of the parameters' names and shapes (and the model type), so that a
// checkpoint is loaded only into the parameters it was saved from.
struct CheckpointLayout {
  int64_t numel = 0;
  // The writer's parameters: their kind ("llama", "host"), names and
  // shapes; a reader with the same hash reads the checkpoint.
  std::string hash;
  // Only the names and element counts in flat order, which any two writers
  // of the same parameters agree on (the trainer knows shapes, a host such
  // as meshrun.torch the element counts): a reader with another `hash` but
  // the same flat layout reads the checkpoint too.
  std::string flat_hash;
  // The parameters in flat order and where each begins, to name the
  // parameter an element belongs to in errors.
  std::vector<std::string> names;
  std::vector<int64_t> offsets;
};
CheckpointLayout checkpoint_layout(const std::string& kind, const std::vector<std::string>& names,
                                   const std::vector<std::vector<int64_t>>& shapes);
CheckpointLayout checkpoint_layout(const ModelConfig& config, const ModelDescription& description);

// What index.json says.
struct CheckpointIndex {
  std::string dir;
  int64_t step = 0;  // optimizer steps taken; the run resumes at this step
  int64_t world_size = 0;
  int64_t numel = 0;
  int64_t seed = 0;                  // train.seed of the run that saved it
  std::string config_hash;           // its writer's CheckpointLayout::hash
  std::vector<std::string> buffers;  // "params", "exp_avg", ...
  // A shard file as its rank wrote it.
  struct File {
    int64_t rank = 0;
    int64_t bytes = 0;
    std::string checksum;  // XXH3-64, checksum_text
  };
  std::map<std::string, File> files;
  // Tensor "<buffer>.<part>" of `file` holds elements [begin, end).
  struct Slice {
    std::string file;
    int64_t part = 0;
    int64_t begin = 0, end = 0;
  };
  std::vector<Slice> slices;
  // Where the reader's parameters lie in the writer's flat layout, when the
  // writer ordered the same named parameters otherwise (a Hugging Face
  // module's registration order against meshrun's forward order): one entry
  // per reader parameter, in the reader's order. Empty when the layouts
  // agree element for element.
  struct Moved {
    int64_t reader_begin = 0, writer_begin = 0, numel = 0;
  };
  std::vector<Moved> moved;
};

// Collective over `world`: every rank writes the `ranges` it is asked to
// save (none: no file) of each of `buffers` to shard_RANK.safetensors in
// DIR.partial, then rank 0 writes index.json there and renames the folder
// to DIR (replacing an older DIR). Over all ranks the ranges must cover the
// layout's elements. A failure on any rank (a full disk) throws on every
// rank, naming the failing rank; DIR is then left as it was.
void save_sharded(const std::string& dir, const CheckpointLayout& layout, int64_t seed,
                  int64_t step, const std::vector<HeldRange>& ranges,
                  const std::vector<FlatBuffer>& buffers, Communicator& world);

// Reads DIR/index.json and checks it is of `layout` (the same parameters by
// name and element count, in any order when index.json lists them), that its
// slices cover
// every element of the layout exactly once, and that the shard files'
// headers hold each slice's tensors and were written by the rank, step and
// parameters index.json names. Throws NOT_FOUND without index.json,
// INVALID_ARGUMENT naming the file and what is wrong otherwise.
CheckpointIndex read_index(const std::string& dir, const CheckpointLayout& layout);

// checkpoint.resume_from's index, checked against the model's parameters and
// the config (seed, number of steps); errors name the key.
CheckpointIndex read_index(const Config& config, const ModelDescription& description);

// Fills the `ranges` of every buffer from the slices overlapping them; each
// shard file read is first checked against index.json's size and checksum.
void load_sharded(const CheckpointIndex& index, const std::vector<HeldRange>& ranges,
                  const std::vector<FlatBuffer>& buffers);

}  // namespace meshrun
