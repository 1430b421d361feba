#include "train/checkpoint.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "train/input_error.hpp"
#include "train/safetensors.hpp"

namespace meshrun::train {
namespace {

namespace fs = std::filesystem;

nlohmann::ordered_json architecture_json(const ModelConfig& m) {
  return {{"vocab_size", m.vocab_size},
          {"hidden_size", m.hidden_size},
          {"intermediate_size", m.intermediate_size},
          {"num_hidden_layers", m.num_hidden_layers},
          {"num_attention_heads", m.num_attention_heads},
          {"num_key_value_heads", m.num_key_value_heads},
          {"tie_word_embeddings", m.tie_word_embeddings}};
}

// FNV-1a of the architecture: a resumed run must have the same parameters.
std::string architecture_hash(const ModelConfig& model) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : architecture_json(model).dump()) {
    hash = (hash ^ uint8_t(c)) * 0x100000001b3ull;
  }
  return fmt::format("{:016x}", hash);
}

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
                            const llama::LlamaModel& model) {
  const auto fail = [&](const std::string& what) {
    return config_error(config, "model.checkpoint", fmt::format("{}: {}", file.path(), what));
  };
  for (const auto& view : model.parameters()) {
    const auto it = file.tensors().find(view.name);
    if (it == file.tensors().end()) throw fail(fmt::format("no tensor '{}'", view.name));
    if (it->second.shape != view.shape) {
      throw fail(fmt::format("tensor '{}' has shape {}; the [model] config needs {}", view.name,
                             shape_text(it->second.shape), shape_text(view.shape)));
    }
  }
  if (file.tensors().size() != model.parameters().size()) {
    for (const auto& [name, tensor] : file.tensors()) {
      bool known = false;
      for (const auto& view : model.parameters()) known = known || view.name == name;
      if (!known) throw fail(fmt::format("tensor '{}' is not a parameter of the model", name));
    }
  }
}

nlohmann::json read_index_json(const Config& config) {
  const std::string path = (fs::path(config.checkpoint.resume_from) / "index.json").string();
  std::ifstream in(path);
  if (!in) {
    throw config_error(config, "checkpoint.resume_from",
                       fmt::format("'{}' has no index.json (not a sharded checkpoint, or its save "
                                   "did not finish)",
                                   config.checkpoint.resume_from));
  }
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw config_error(config, "checkpoint.resume_from", fmt::format("{}: {}", path, error.what()));
  }
}

}  // namespace

llama::LlamaConfig llama_config(const ModelConfig& m) {
  return {m.vocab_size,        m.hidden_size,         m.intermediate_size,
          m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
          m.rms_norm_eps,      m.rope_theta,          m.tie_word_embeddings};
}

nlohmann::ordered_json hf_config_json(const ModelConfig& m) {
  nlohmann::ordered_json json = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}};
  json.update(architecture_json(m));
  json.update(nlohmann::ordered_json{{"head_dim", m.hidden_size / m.num_attention_heads},
                                     {"hidden_act", "silu"},
                                     {"max_position_embeddings", m.max_position_embeddings},
                                     {"rms_norm_eps", m.rms_norm_eps},
                                     {"rope_theta", m.rope_theta},
                                     {"attention_bias", false},
                                     {"mlp_bias", false},
                                     {"torch_dtype", m.torch_dtype}});
  return json;
}

void export_consolidated(const std::string& dir, const ModelConfig& config,
                         const llama::LlamaModel& model) {
  std::vector<TensorToWrite> tensors;
  for (const auto& view : model.parameters()) {
    tensors.push_back({view.name, view.shape, view.data, view.numel});
  }
  fs::create_directories(dir);
  write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors,
                    config.torch_dtype == "bfloat16");
  write_json((fs::path(dir) / "config.json").string(), hf_config_json(config));
}

void read_consolidated(const Config& config, llama::LlamaModel& model, bool load) {
  const std::string path = (fs::path(config.model.checkpoint) / "model.safetensors").string();
  std::optional<SafetensorsFile> file;
  try {
    file.emplace(path);
  } catch (const Error& error) {
    throw config_error(config, "model.checkpoint", error.what());
  }
  check_names_and_shapes(config, *file, model);
  if (!load) return;
  for (auto& view : model.parameters()) file->read(view.name, 0, view.numel, view.data);
}

void save_sharded(const std::string& dir, const Config& config, int64_t step, int64_t numel,
                  const std::vector<FlatBuffer>& buffers, Communicator& world) {
  const int64_t rank = world.rank(), size = world.size();
  const auto slice = [&](int64_t r) { return std::pair{r * numel / size, (r + 1) * numel / size}; };
  const auto [begin, end] = slice(rank);
  fs::create_directories(dir);
  std::vector<TensorToWrite> tensors;
  for (const auto& buffer : buffers) {
    tensors.push_back({buffer.name, {end - begin}, buffer.data + begin, end - begin});
  }
  write_safetensors((fs::path(dir) / fmt::format("shard_{}.safetensors", rank)).string(), tensors,
                    false);
  // index.json only once every shard is on disk: its presence marks a
  // complete checkpoint.
  world.barrier().wait();
  if (rank != 0) return;
  nlohmann::ordered_json slices = nlohmann::ordered_json::array();
  for (int64_t r = 0; r < size; ++r) {
    slices.push_back({{"rank", r},
                      {"file", fmt::format("shard_{}.safetensors", r)},
                      {"begin", slice(r).first},
                      {"end", slice(r).second}});
  }
  nlohmann::ordered_json buffer_names = nlohmann::ordered_json::array();
  for (const auto& buffer : buffers) buffer_names.push_back(buffer.name);
  write_json((fs::path(dir) / "index.json").string(),
             {{"step", step},
              {"world_size", size},
              {"numel", numel},
              {"buffers", buffer_names},
              {"slices", slices},
              {"data", {{"seed", config.train.seed}, {"next_step", step}}},
              {"config_hash", architecture_hash(config.model)}});
}

CheckpointIndex read_index(const Config& config, int64_t numel) {
  const nlohmann::json json = read_index_json(config);
  const auto fail = [&](const std::string& what) {
    return config_error(config, "checkpoint.resume_from",
                        fmt::format("'{}': {}", config.checkpoint.resume_from, what));
  };
  CheckpointIndex index;
  try {
    index.dir = config.checkpoint.resume_from;
    index.step = json.at("step").get<int64_t>();
    index.world_size = json.at("world_size").get<int64_t>();
    index.numel = json.at("numel").get<int64_t>();
    for (const auto& slice : json.at("slices")) {
      index.slices.push_back({slice.at("file").get<std::string>(), slice.at("begin").get<int64_t>(),
                              slice.at("end").get<int64_t>()});
    }
    if (json.at("config_hash").get<std::string>() != architecture_hash(config.model) ||
        index.numel != numel) {
      throw fail("was written for another model architecture than [model] describes");
    }
    if (json.at("data").at("seed").get<int64_t>() != config.train.seed) {
      throw config_error(
          config, "train.seed",
          fmt::format("{} differs from the seed of checkpoint '{}' ({}); resuming "
                      "needs the same data order",
                      config.train.seed, index.dir, json.at("data").at("seed").get<int64_t>()));
    }
  } catch (const nlohmann::json::exception& error) {
    throw fail(fmt::format("malformed index.json: {}", error.what()));
  }
  if (index.step > config.train.steps) {
    throw fail(
        fmt::format("is at step {}, beyond train.steps ({})", index.step, config.train.steps));
  }
  return index;
}

void load_sharded(const CheckpointIndex& index, int64_t begin, int64_t end,
                  const std::vector<FlatBuffer>& buffers) {
  for (const auto& slice : index.slices) {
    const int64_t first = std::max(begin, slice.begin), last = std::min(end, slice.end);
    if (first >= last) continue;
    const SafetensorsFile file((fs::path(index.dir) / slice.file).string());
    for (const auto& buffer : buffers) {
      file.read(buffer.name, first - slice.begin, last - first, buffer.data + first);
    }
  }
}

}  // namespace meshrun::train
