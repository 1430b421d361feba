#include "train/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "train/input_error.hpp"
#include "train/safetensors.hpp"

namespace meshrun::train {
namespace {

namespace fs = std::filesystem;

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

void write_json(const std::string& path, const nlohmann::ordered_json& json) {
  const std::string temporary = path + ".partial";
  std::ofstream(temporary) << json.dump(2) << "\n";
  fs::rename(temporary, path);
}

// The safetensors file must hold exactly the model's tensors, shapes equal.
void check_names_and_shapes(const Config& config, const SafetensorsFile& file,
                            const ModelDescription& description) {
  const auto fail = [&](const std::string& what) {
    return config_error(config, "model.checkpoint", fmt::format("{}: {}", file.path(), what));
  };
  for (const auto& parameter : description.parameters) {
    const auto it = file.tensors().find(parameter.name);
    if (it == file.tensors().end()) throw fail(fmt::format("no tensor '{}'", parameter.name));
    if (it->second.shape != parameter.shape) {
      throw fail(fmt::format("tensor '{}' has shape {}; the [model] config needs {}",
                             parameter.name, shape_text(it->second.shape),
                             shape_text(parameter.shape)));
    }
  }
  for (const auto& [name, tensor] : file.tensors()) {
    if (description.parameter_index(name) < 0) {
      throw fail(fmt::format("tensor '{}' is not a parameter of the model", name));
    }
  }
}

nlohmann::json read_index_json(const std::string& dir) {
  const std::string path = (fs::path(dir) / "index.json").string();
  std::ifstream in(path);
  if (!in) {
    throw Error(MESHRUN_NOT_FOUND,
                fmt::format("'{}' has no index.json (not a sharded checkpoint, or its save did "
                            "not finish)",
                            dir));
  }
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw invalid_argument(fmt::format("{}: {}", path, error.what()));
  }
}

}  // namespace

nlohmann::ordered_json hf_config_json(const ModelConfig& config,
                                      const ModelDescription& description) {
  nlohmann::ordered_json json = description.config;
  json["torch_dtype"] = config.torch_dtype;
  return json;
}

void export_consolidated(const std::string& dir, const ModelConfig& config,
                         const ModelDescription& description, const float* parameters) {
  std::vector<TensorToWrite> tensors;
  for (const auto& parameter : description.parameters) {
    tensors.push_back(
        {parameter.name, parameter.shape, parameters + parameter.offset, parameter.numel});
  }
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors,
                    config.torch_dtype == "bfloat16");
  write_json((fs::path(dir) / "config.json").string(), hf_config_json(config, description));
}

void read_consolidated(const Config& config, const ModelDescription& description,
                       float* parameters) {
  const std::string path = (fs::path(config.model.checkpoint) / "model.safetensors").string();
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(path);
  } catch (const Error& error) {
    throw config_error(config, "model.checkpoint", error.what());
  }
  check_names_and_shapes(config, *file, description);
  if (parameters == nullptr) return;
  for (const auto& parameter : description.parameters) {
    file->read(parameter.name, 0, parameter.numel, parameters + parameter.offset);
  }
}

namespace {

// Every rank's ranges, on rank 0 (others get an empty list): two all_gathers
// over `world`, the counts and then the ranges padded to the largest count.
std::vector<std::vector<HeldRange>> gather_ranges(const std::vector<HeldRange>& ranges,
                                                  Communicator& world) {
  const int64_t size = world.size();
  int64_t count = int64_t(ranges.size());
  std::vector<int64_t> counts(size_t(size), 0);
  FlatTensor count_send(&count, dtype_int64(), 1);
  FlatTensor count_recv(counts.data(), dtype_int64(), size);
  world.all_gather(count_send.get(), count_recv.get()).wait();
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<int64_t> mine(size_t(2 * most), 0), all(size_t(2 * most * size), 0);
  for (size_t k = 0; k < ranges.size(); ++k) {
    mine[2 * k] = ranges[k].global_begin;
    mine[2 * k + 1] = ranges[k].count;
  }
  FlatTensor send(mine.data(), dtype_int64(), 2 * most);
  FlatTensor recv(all.data(), dtype_int64(), 2 * most * size);
  if (most > 0) world.all_gather(send.get(), recv.get()).wait();
  std::vector<std::vector<HeldRange>> by_rank(world.rank() == 0 ? size_t(size) : 0);
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (int64_t k = 0; k < counts[r]; ++k) {
      const size_t at = size_t(2 * (int64_t(r) * most + k));
      by_rank[r].push_back({all[at], 0, all[at + 1]});
    }
  }
  return by_rank;
}

std::string shard_file(int64_t rank) { return fmt::format("shard_{}.safetensors", rank); }

}  // namespace

CheckpointLayout checkpoint_layout(const std::string& kind, const std::vector<std::string>& names,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  nlohmann::ordered_json parameters = nlohmann::ordered_json::array();
  CheckpointLayout layout;
  for (size_t p = 0; p < names.size(); ++p) {
    parameters.push_back({names[p], shapes[p]});
    int64_t numel = 1;
    for (const int64_t extent : shapes[p]) numel *= extent;
    layout.numel += numel;
  }
  // FNV-1a: a resumed run must have the same parameters in the same layout.
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : kind + parameters.dump()) hash = (hash ^ uint8_t(c)) * 0x100000001b3ull;
  layout.hash = fmt::format("{:016x}", hash);
  return layout;
}

CheckpointLayout checkpoint_layout(const ModelConfig& config, const ModelDescription& description) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : description.parameters) {
    names.push_back(p.name);
    shapes.push_back(p.shape);
  }
  return checkpoint_layout(config.model_type, names, shapes);
}

void save_sharded(const std::string& dir, const CheckpointLayout& layout, int64_t seed,
                  int64_t step, const std::vector<HeldRange>& ranges,
                  const std::vector<FlatBuffer>& buffers, Communicator& world) {
  fs::create_directories(dir);
  std::vector<TensorToWrite> tensors;
  for (const auto& buffer : buffers) {
    for (size_t k = 0; k < ranges.size(); ++k) {
      tensors.push_back({fmt::format("{}.{}", buffer.name, k),
                         {ranges[k].count},
                         buffer.data + ranges[k].local_begin,
                         ranges[k].count});
    }
  }
  if (!tensors.empty()) {
    write_safetensors((fs::path(dir) / shard_file(world.rank())).string(), tensors, false);
  }
  const auto by_rank = gather_ranges(ranges, world);
  // index.json only once every shard is on disk: its presence marks a
  // complete checkpoint.
  world.barrier().wait();
  if (world.rank() != 0) return;
  nlohmann::ordered_json slices = nlohmann::ordered_json::array();
  for (size_t r = 0; r < by_rank.size(); ++r) {
    for (size_t k = 0; k < by_rank[r].size(); ++k) {
      const HeldRange& range = by_rank[r][k];
      slices.push_back({{"rank", r},
                        {"file", shard_file(int64_t(r))},
                        {"part", k},
                        {"begin", range.global_begin},
                        {"end", range.global_begin + range.count}});
    }
  }
  nlohmann::ordered_json buffer_names = nlohmann::ordered_json::array();
  for (const auto& buffer : buffers) buffer_names.push_back(buffer.name);
  write_json((fs::path(dir) / "index.json").string(),
             {{"step", step},
              {"world_size", world.size()},
              {"numel", layout.numel},
              {"buffers", buffer_names},
              {"slices", slices},
              {"data", {{"seed", seed}, {"next_step", step}}},
              {"config_hash", layout.hash}});
}

CheckpointIndex read_index(const std::string& dir, const CheckpointLayout& layout) {
  const nlohmann::json json = read_index_json(dir);
  CheckpointIndex index;
  try {
    index.dir = dir;
    index.step = json.at("step").get<int64_t>();
    index.world_size = json.at("world_size").get<int64_t>();
    index.numel = json.at("numel").get<int64_t>();
    index.seed = json.at("data").at("seed").get<int64_t>();
    for (const auto& slice : json.at("slices")) {
      index.slices.push_back({slice.at("file").get<std::string>(), slice.at("part").get<int64_t>(),
                              slice.at("begin").get<int64_t>(), slice.at("end").get<int64_t>()});
    }
    index.buffers = json.at("buffers").get<std::vector<std::string>>();
    if (json.at("config_hash").get<std::string>() != layout.hash || index.numel != layout.numel) {
      throw invalid_argument(fmt::format("'{}' was written for other parameters", dir));
    }
  } catch (const nlohmann::json::exception& error) {
    throw invalid_argument(fmt::format("'{}': malformed index.json: {}", dir, error.what()));
  }
  return index;
}

CheckpointIndex read_index(const Config& config, const ModelDescription& description) {
  const std::string& dir = config.checkpoint.resume_from;
  CheckpointIndex index;
  try {
    index = read_index(dir, checkpoint_layout(config.model, description));
  } catch (const Error& error) {
    throw config_error(
        config, "checkpoint.resume_from",
        std::string(error.what()) + (error.code() == MESHRUN_INVALID_ARGUMENT
                                         ? " (another model architecture than [model] describes?)"
                                         : ""));
  }
  if (index.seed != config.train.seed) {
    throw config_error(config, "train.seed",
                       fmt::format("{} differs from the seed of checkpoint '{}' ({}); resuming "
                                   "needs the same data order",
                                   config.train.seed, dir, index.seed));
  }
  if (index.step > config.train.steps) {
    throw config_error(config, "checkpoint.resume_from",
                       fmt::format("'{}' is at step {}, beyond train.steps ({})", dir, index.step,
                                   config.train.steps));
  }
  return index;
}

void load_sharded(const CheckpointIndex& index, const std::vector<HeldRange>& ranges,
                  const std::vector<FlatBuffer>& buffers) {
  std::map<std::string, SafetensorsFile> files;
  for (const auto& slice : index.slices) {
    for (const HeldRange& range : ranges) {
      const int64_t first = std::max(range.global_begin, slice.begin);
      const int64_t last = std::min(range.global_begin + range.count, slice.end);
      if (first >= last) continue;
      auto file = files.find(slice.file);
      if (file == files.end()) {
        file = files.emplace(slice.file, (fs::path(index.dir) / slice.file).string()).first;
      }
      const int64_t local = range.local_begin + (first - range.global_begin);
      for (const auto& buffer : buffers) {
        file->second.read(fmt::format("{}.{}", buffer.name, slice.part), first - slice.begin,
                          last - first, buffer.data + local);
      }
    }
  }
}

}  // namespace meshrun::train
