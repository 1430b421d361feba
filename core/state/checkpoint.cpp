#include "state/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "state/durable_io.hpp"
#include "state/input_error.hpp"
#include "state/safetensors.hpp"

namespace meshrun {
namespace {

// FNV-1a of `text`, as 16 hex digits.
std::string fnv1a_hex(const std::string& text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char c : text) hash = (hash ^ uint8_t(c)) * 0x100000001b3ull;
  return fmt::format("{:016x}", hash);
}

namespace fs = std::filesystem;

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

void write_json(const std::string& path, const nlohmann::ordered_json& json) {
  write_atomically(path, [&](OutputFile& out) { out.write(json.dump(2) + "\n"); });
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

ConsolidatedWeights::ConsolidatedWeights(const Config& config, const ModelDescription& description)
    : path_((fs::path(config.model.checkpoint) / "model.safetensors").string()) {
  try {
    file_ = std::make_unique<SafetensorsFile>(path_);
  } catch (const Error& error) {
    throw config_error(config, "model.checkpoint", error.what());
  }
  check_names_and_shapes(config, *file_, description);
}

ConsolidatedWeights::~ConsolidatedWeights() = default;

void ConsolidatedWeights::read(const ModelParameter& parameter, float* values) const {
  file_->read(parameter.name, 0, parameter.numel, values);
  // The file has no checksum: a NaN or infinity written into it would
  // otherwise only show as a NaN loss steps later.
  const float* bad = std::find_if(values, values + parameter.numel,
                                  [](float value) { return !std::isfinite(value); });
  if (bad != values + parameter.numel) {
    throw invalid_argument(
        fmt::format("{}: tensor '{}' holds {} at element {}; weights must be "
                    "finite",
                    path_, parameter.name, *bad, bad - values));
  }
}

void read_consolidated(const Config& config, const ModelDescription& description,
                       float* parameters) {
  const ConsolidatedWeights weights(config, description);
  if (parameters == nullptr) return;
  for (const auto& parameter : description.parameters) {
    weights.read(parameter, parameters + parameter.offset);
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

// The index format this build writes and reads: 2 added the shard files'
// sizes and checksums ("files") and the shards' owners in their metadata.
constexpr int64_t kIndexFormat = 2;

// Runs `attempt`, this rank's part of a collective save, and makes a failure
// on any rank everyone's: the failing rank rethrows its own error, the others
// throw one naming the lowest failing rank, so no rank waits in a later
// collective for a rank that gave up.
void on_all_ranks(Communicator& world, const std::string& what,
                  const std::function<void()>& attempt) {
  std::exception_ptr failure;
  try {
    attempt();
  } catch (...) {
    failure = std::current_exception();
  }
  int64_t lowest_failed = failure ? world.size() - world.rank() : 0;  // max picks the lowest
  FlatTensor tensor(&lowest_failed, dtype_int64(), 1);
  world.all_reduce(tensor.get(), ReduceOp::max).wait();
  if (failure) std::rethrow_exception(failure);
  if (lowest_failed > 0) {
    throw Error(MESHRUN_UNAVAILABLE, fmt::format("{}: rank {} failed (its error says why)", what,
                                                 world.size() - lowest_failed));
  }
}

// Every rank's shard file (bytes, checksum; bytes < 0 for a rank without
// one), on every rank.
std::vector<std::pair<int64_t, uint64_t>> gather_files(const WrittenFile& written,
                                                       Communicator& world) {
  int64_t mine[2] = {written.bytes, int64_t(written.checksum)};
  std::vector<int64_t> all(size_t(2 * world.size()));
  FlatTensor send(mine, dtype_int64(), 2);
  FlatTensor recv(all.data(), dtype_int64(), int64_t(all.size()));
  world.all_gather(send.get(), recv.get()).wait();
  std::vector<std::pair<int64_t, uint64_t>> files;
  for (size_t r = 0; r < size_t(world.size()); ++r) files.emplace_back(all[2 * r], all[2 * r + 1]);
  return files;
}

// Puts the complete folder `temporary` at `target`. An older `target` is moved
// aside first and removed after, so at every moment `target` is the old
// checkpoint, the new one, or absent, never a mixture.
void replace_directory(const fs::path& temporary, const fs::path& target) {
  sync_directory(temporary.string());
  const fs::path aside = target.string() + ".old";
  fs::remove_all(aside);
  if (fs::exists(target)) fs::rename(target, aside);
  fs::rename(temporary, target);
  sync_directory(target.parent_path().string());
  fs::remove_all(aside);
}

// The layout's parameters as index.json lists them: [name, numel] in flat
// order, so that a reader ordering them otherwise finds each by name.
nlohmann::ordered_json parameter_list(const CheckpointLayout& layout) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t p = 0; p < layout.names.size(); ++p) {
    const int64_t end = p + 1 < layout.names.size() ? layout.offsets[p + 1] : layout.numel;
    list.push_back({layout.names[p], end - layout.offsets[p]});
  }
  return list;
}

nlohmann::ordered_json index_json(const CheckpointLayout& layout, int64_t seed, int64_t step,
                                  const std::vector<FlatBuffer>& buffers,
                                  const std::vector<std::vector<HeldRange>>& by_rank,
                                  const std::vector<std::pair<int64_t, uint64_t>>& files) {
  nlohmann::ordered_json file_list = nlohmann::ordered_json::array();
  for (size_t r = 0; r < files.size(); ++r) {
    if (files[r].first < 0) continue;
    file_list.push_back({{"file", shard_file(int64_t(r))},
                         {"rank", r},
                         {"bytes", files[r].first},
                         {"xxh3_64", checksum_text(files[r].second)}});
  }
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
  return {{"format_version", kIndexFormat},
          {"step", step},
          {"world_size", int64_t(by_rank.size())},
          {"numel", layout.numel},
          {"buffers", buffer_names},
          {"files", file_list},
          {"slices", slices},
          {"data", {{"seed", seed}, {"next_step", step}}},
          {"config_hash", layout.hash},
          {"layout_hash", layout.flat_hash},
          {"parameters", parameter_list(layout)}};
}

}  // namespace

CheckpointLayout checkpoint_layout(const std::string& kind, const std::vector<std::string>& names,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  nlohmann::ordered_json parameters = nlohmann::ordered_json::array();
  CheckpointLayout layout;
  layout.names = names;
  for (size_t p = 0; p < names.size(); ++p) {
    parameters.push_back({names[p], shapes[p]});
    int64_t numel = 1;
    for (const int64_t extent : shapes[p]) numel *= extent;
    layout.offsets.push_back(layout.numel);
    layout.numel += numel;
  }
  nlohmann::ordered_json flat = nlohmann::ordered_json::array();
  for (size_t p = 0; p < names.size(); ++p) {
    const int64_t end = p + 1 < names.size() ? layout.offsets[p + 1] : layout.numel;
    flat.push_back({names[p], end - layout.offsets[p]});
  }
  // A resumed run must have the same parameters in the same layout.
  layout.hash = fnv1a_hex(kind + parameters.dump());
  layout.flat_hash = fnv1a_hex(flat.dump());
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
  fs::path target = fs::path(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();  // "DIR/"
  const fs::path temporary = target.string() + ".partial";
  const std::string what = fmt::format("checkpoint '{}' not saved", dir);
  // A .partial left by an interrupted save may hold stale shards.
  on_all_ranks(world, what, [&] {
    if (world.rank() != 0) return;
    fs::remove_all(temporary);
    fs::create_directories(temporary);
  });
  std::vector<TensorToWrite> tensors;
  for (const auto& buffer : buffers) {
    for (size_t k = 0; k < ranges.size(); ++k) {
      tensors.push_back({fmt::format("{}.{}", buffer.name, k),
                         {ranges[k].count},
                         buffer.data + ranges[k].local_begin,
                         ranges[k].count});
    }
  }
  WrittenFile written{-1, 0};
  on_all_ranks(world, what, [&] {
    if (tensors.empty()) return;
    written = write_safetensors((temporary / shard_file(world.rank())).string(), tensors, false,
                                {{"meshrun.rank", std::to_string(world.rank())},
                                 {"meshrun.world_size", std::to_string(world.size())},
                                 {"meshrun.step", std::to_string(step)},
                                 {"meshrun.config_hash", layout.hash}});
  });
  const auto files = gather_files(written, world);
  const auto by_rank = gather_ranges(ranges, world);
  // index.json only once every shard is on disk, the folder renamed into
  // place only once index.json is.
  on_all_ranks(world, what, [&] {
    if (world.rank() != 0) return;
    write_json((temporary / "index.json").string(),
               index_json(layout, seed, step, buffers, by_rank, files));
    replace_directory(temporary, target);
  });
}

namespace {

using Slice = CheckpointIndex::Slice;

std::string describe(const Slice& slice, size_t k) {
  return fmt::format("slice {} ({} part {}, elements [{}, {}))", k, slice.file, slice.part,
                     slice.begin, slice.end);
}

// "parameter 'NAME' element I" for element `element` of the flat layout.
std::string parameter_at(const CheckpointLayout& layout, int64_t element) {
  const auto after = std::upper_bound(layout.offsets.begin(), layout.offsets.end(), element);
  if (after == layout.offsets.begin()) return fmt::format("element {}", element);
  const size_t p = size_t(after - layout.offsets.begin() - 1);
  return fmt::format("parameter '{}' element {}", layout.names[p], element - layout.offsets[p]);
}

// The writer's layout as index.json's "parameters" lists it.
CheckpointLayout listed_layout(const nlohmann::json& parameters) {
  CheckpointLayout layout;
  for (const auto& parameter : parameters) {
    layout.names.push_back(parameter.at(0).get<std::string>());
    layout.offsets.push_back(layout.numel);
    layout.numel += parameter.at(1).get<int64_t>();
  }
  return layout;
}

// Where each of the reader's parameters lies in the writer's layout, found
// by name; INVALID_ARGUMENT naming the first parameter the two do not share
// or whose size differs.
std::vector<CheckpointIndex::Moved> moved_parameters(const std::string& dir,
                                                     const CheckpointLayout& writer,
                                                     const CheckpointLayout& reader) {
  const auto numel = [](const CheckpointLayout& layout, size_t p) {
    return (p + 1 < layout.offsets.size() ? layout.offsets[p + 1] : layout.numel) -
           layout.offsets[p];
  };
  std::map<std::string, size_t> in_writer;
  for (size_t p = 0; p < writer.names.size(); ++p) in_writer.emplace(writer.names[p], p);
  if (in_writer.size() != writer.names.size() || writer.names.size() != reader.names.size()) {
    throw invalid_argument(fmt::format("'{}' holds {} parameters, these are {}", dir,
                                       writer.names.size(), reader.names.size()));
  }
  std::vector<CheckpointIndex::Moved> moved;
  for (size_t p = 0; p < reader.names.size(); ++p) {
    const auto found = in_writer.find(reader.names[p]);
    if (found == in_writer.end()) {
      throw invalid_argument(fmt::format("'{}' holds no parameter '{}'", dir, reader.names[p]));
    }
    if (numel(writer, found->second) != numel(reader, p)) {
      throw invalid_argument(fmt::format("'{}' holds parameter '{}' with {} elements, not {}", dir,
                                         reader.names[p], numel(writer, found->second),
                                         numel(reader, p)));
    }
    moved.push_back({reader.offsets[p], writer.offsets[found->second], numel(reader, p)});
  }
  return moved;
}

CheckpointIndex parse_index(const std::string& dir, const nlohmann::json& json) {
  CheckpointIndex index;
  index.dir = dir;
  index.step = json.at("step").get<int64_t>();
  index.world_size = json.at("world_size").get<int64_t>();
  index.numel = json.at("numel").get<int64_t>();
  index.seed = json.at("data").at("seed").get<int64_t>();
  index.config_hash = json.at("config_hash").get<std::string>();
  for (const auto& file : json.at("files")) {
    index.files[file.at("file").get<std::string>()] = {file.at("rank").get<int64_t>(),
                                                       file.at("bytes").get<int64_t>(),
                                                       file.at("xxh3_64").get<std::string>()};
  }
  for (const auto& slice : json.at("slices")) {
    index.slices.push_back({slice.at("file").get<std::string>(), slice.at("part").get<int64_t>(),
                            slice.at("begin").get<int64_t>(), slice.at("end").get<int64_t>()});
  }
  index.buffers = json.at("buffers").get<std::vector<std::string>>();
  return index;
}

// Each file is its rank's shard_RANK.safetensors (so no name leads out of
// the folder), and each slice names one of them.
void check_files(const std::string& path, const CheckpointIndex& index) {
  for (const auto& [file, entry] : index.files) {
    if (entry.rank < 0 || entry.rank >= index.world_size || file != shard_file(entry.rank)) {
      throw invalid_argument(
          fmt::format("{}: file '{}' of rank {}; valid: shard_R.safetensors of "
                      "a rank R in [0, {})",
                      path, file, entry.rank, index.world_size));
    }
  }
  for (size_t k = 0; k < index.slices.size(); ++k) {
    if (index.files.count(index.slices[k].file) == 0) {
      throw invalid_argument(fmt::format("{}: {} names a file that \"files\" does not list", path,
                                         describe(index.slices[k], k)));
    }
  }
}

// The slices, in order of begin, must tile [0, numel): every element of every
// parameter in exactly one slice.
void check_coverage(const std::string& path, const CheckpointIndex& index,
                    const CheckpointLayout& layout) {
  std::vector<size_t> order(index.slices.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return index.slices[a].begin < index.slices[b].begin; });
  int64_t covered = 0;
  for (const size_t k : order) {
    const Slice& slice = index.slices[k];
    if (slice.begin < 0 || slice.end < slice.begin || slice.end > layout.numel) {
      throw invalid_argument(fmt::format("{}: {} does not fit the {} elements of the parameters",
                                         path, describe(slice, k), layout.numel));
    }
    if (slice.begin > covered) {
      throw invalid_argument(
          fmt::format("{}: no slice holds elements [{}, {}) (from {}): a "
                      "rank's slices are missing",
                      path, covered, slice.begin, parameter_at(layout, covered)));
    }
    if (slice.begin < covered) {
      throw invalid_argument(fmt::format("{}: {} overlaps another slice at {}", path,
                                         describe(slice, k), parameter_at(layout, slice.begin)));
    }
    covered = slice.end;
  }
  if (covered != layout.numel) {
    throw invalid_argument(
        fmt::format("{}: no slice holds elements [{}, {}) (from {}): a rank's "
                    "slices are missing",
                    path, covered, layout.numel, parameter_at(layout, covered)));
  }
}

// The shard's metadata says which rank of which save wrote it: a file
// swapped for another rank's, or copied from another checkpoint, is named.
void check_owner(const CheckpointIndex& index, const SafetensorsFile& shard,
                 const CheckpointIndex::File& entry) {
  const std::map<std::string, std::string> expected = {
      {"meshrun.rank", std::to_string(entry.rank)},
      {"meshrun.world_size", std::to_string(index.world_size)},
      {"meshrun.step", std::to_string(index.step)},
      {"meshrun.config_hash", index.config_hash}};
  for (const auto& [key, value] : expected) {
    const auto found = shard.metadata().find(key);
    const std::string actual = found == shard.metadata().end() ? "(none)" : found->second;
    if (actual != value) {
      throw invalid_argument(
          fmt::format("{}: its __metadata__ has {} = {}, index.json expects {} "
                      "(the ownership check: this file was written by another "
                      "rank or save than index.json lists it for)",
                      shard.path(), key, actual, value));
    }
  }
}

// Every slice's tensors are in its file, float32 and of the slice's length.
void check_slice_tensors(const std::string& path, const CheckpointIndex& index,
                         const std::map<std::string, SafetensorsFile>& shards) {
  for (size_t k = 0; k < index.slices.size(); ++k) {
    const Slice& slice = index.slices[k];
    const SafetensorsFile& shard = shards.at(slice.file);
    for (const auto& buffer : index.buffers) {
      const std::string name = fmt::format("{}.{}", buffer, slice.part);
      const auto found = shard.tensors().find(name);
      if (found == shard.tensors().end()) {
        throw invalid_argument(fmt::format("{}: {} needs tensor '{}', which {} does not hold", path,
                                           describe(slice, k), name, shard.path()));
      }
      if (found->second.dtype != "F32" || found->second.numel != slice.end - slice.begin) {
        throw invalid_argument(
            fmt::format("{}: {} needs tensor '{}' as F32 of {} elements; {} "
                        "holds {} of {}",
                        path, describe(slice, k), name, slice.end - slice.begin, shard.path(),
                        found->second.dtype, found->second.numel));
      }
    }
  }
}

void check_shards(const std::string& path, const CheckpointIndex& index) {
  std::map<std::string, SafetensorsFile> shards;
  for (const auto& [file, entry] : index.files) {
    const auto& shard = shards.emplace(file, (fs::path(index.dir) / file).string()).first->second;
    check_owner(index, shard, entry);
  }
  check_slice_tensors(path, index, shards);
}

// The whole file against index.json's record: the check that catches a
// byte changed (a NaN written in) or a file replaced by one of equal size.
void check_checksum(const CheckpointIndex& index, const std::string& file) {
  const CheckpointIndex::File& entry = index.files.at(file);
  const std::string path = (fs::path(index.dir) / file).string();
  std::error_code error;
  const auto bytes = int64_t(fs::file_size(path, error));
  if (error || bytes != entry.bytes) {
    throw invalid_argument(
        fmt::format("{}: {} bytes, index.json records {} (the size check: the "
                    "file was truncated or replaced)",
                    path, error ? 0 : bytes, entry.bytes));
  }
  const std::string checksum = checksum_text(file_checksum(path));
  if (checksum != entry.checksum) {
    throw invalid_argument(
        fmt::format("{}: XXH3-64 checksum {}, index.json records {} (the "
                    "checksum check: the file changed after it was saved)",
                    path, checksum, entry.checksum));
  }
}

}  // namespace

CheckpointIndex read_index(const std::string& dir, const CheckpointLayout& layout) {
  const nlohmann::json json = read_index_json(dir);
  const std::string path = (fs::path(dir) / "index.json").string();
  if (!json.is_object() || !json.contains("format_version") ||
      json["format_version"] != kIndexFormat) {
    throw invalid_argument(
        fmt::format("{}: no \"format_version\": {} (an older meshrun saved it, "
                    "without the shards' checksums this meshrun verifies "
                    "before loading); resume from a checkpoint saved by this "
                    "version",
                    path, kIndexFormat));
  }
  CheckpointIndex index;
  CheckpointLayout written = layout;
  try {
    index = parse_index(dir, json);
    // The same writer's parameters, or the same flat layout written by
    // another (meshrun train's checkpoint read by a host, and back), or the
    // same named parameters in another order.
    const bool same_flat_layout = json.contains("layout_hash") &&
                                  json.at("layout_hash").get<std::string>() == layout.flat_hash;
    if (index.config_hash != layout.hash && !same_flat_layout) {
      if (!json.contains("parameters")) {
        throw invalid_argument(fmt::format("'{}' was written for other parameters", dir));
      }
      written = listed_layout(json.at("parameters"));
      index.moved = moved_parameters(dir, written, layout);
    }
    if (index.numel != layout.numel) {
      throw invalid_argument(fmt::format("'{}' was written for other parameters", dir));
    }
  } catch (const nlohmann::json::exception& error) {
    throw invalid_argument(fmt::format("'{}': malformed index.json: {}", dir, error.what()));
  }
  check_files(path, index);
  check_coverage(path, index, written);
  check_shards(path, index);
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

namespace {

// `ranges` of the reader's layout as ranges of the writer's: each split
// where it crosses into another parameter, then moved to where the writer
// put that parameter.
std::vector<HeldRange> in_writer_layout(const CheckpointIndex& index,
                                        const std::vector<HeldRange>& ranges) {
  if (index.moved.empty()) return ranges;
  std::vector<HeldRange> moved;
  for (const HeldRange& range : ranges) {
    for (const auto& parameter : index.moved) {
      const int64_t first = std::max(range.global_begin, parameter.reader_begin);
      const int64_t last =
          std::min(range.global_begin + range.count, parameter.reader_begin + parameter.numel);
      if (first >= last) continue;
      moved.push_back({parameter.writer_begin + (first - parameter.reader_begin),
                       range.local_begin + (first - range.global_begin), last - first});
    }
  }
  return moved;
}

}  // namespace

void load_sharded(const CheckpointIndex& index, const std::vector<HeldRange>& reader_ranges,
                  const std::vector<FlatBuffer>& buffers) {
  std::map<std::string, SafetensorsFile> files;
  const std::vector<HeldRange> ranges = in_writer_layout(index, reader_ranges);
  for (const auto& slice : index.slices) {
    for (const HeldRange& range : ranges) {
      const int64_t first = std::max(range.global_begin, slice.begin);
      const int64_t last = std::min(range.global_begin + range.count, slice.end);
      if (first >= last) continue;
      auto file = files.find(slice.file);
      if (file == files.end()) {
        check_checksum(index, slice.file);
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

}  // namespace meshrun
