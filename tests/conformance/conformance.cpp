// meshrun-conformance: checks one plugin file against the ABI rules of
// docs/design.md (entry point, exports, version, identity, NULL handles, too-small
// and larger-than-known structs, errors round-tripped, extensions). Runs on
// every shipped plugin through ctest, and on a third-party one:
//
//   meshrun-conformance --plugin path/to/meshrun_strategy_mine.so
//
// (or MESHRUN_CONFORMANCE_PLUGIN=path). Any other argument is Catch2's.
#include <dlfcn.h>
#include <elf.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "catch_runner.hpp"
#include "errors.hpp"
#include "model/model.hpp"
#include "plugin/loader.hpp"
#include "raw_stage_setup.hpp"

namespace {

std::string plugin_path;

// A type no extension will ever be assigned: lookups of it must miss.
constexpr int32_t kUnknownExtension = 0x7fffffff;

// Extension lists are walked this far at most: a longer one is taken to be a
// cycle.
constexpr int kMaxExtensions = 1000;

// The plugin under test, opened once for the whole run and never closed, as
// a host keeps its plugins.
struct OpenedPlugin {
  meshrun_plugin_get_api_fn get_api = nullptr;
  std::string failure;  // why the plugin could not be opened
};

const OpenedPlugin& opened() {
  static const OpenedPlugin plugin = [] {
    OpenedPlugin result;
    const std::string open_path =
        plugin_path.find('/') == std::string::npos ? "./" + plugin_path : plugin_path;
    void* handle = dlopen(open_path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      result.failure = std::string("dlopen failed: ") + dlerror();
      return result;
    }
    dlerror();
    void* entry = dlsym(handle, MESHRUN_PLUGIN_ENTRY_SYMBOL);
    if (entry == nullptr) {
      result.failure = "no " MESHRUN_PLUGIN_ENTRY_SYMBOL " symbol";
      return result;
    }
    result.get_api = reinterpret_cast<meshrun_plugin_get_api_fn>(entry);
    return result;
  }();
  return plugin;
}

// The plugin's table, once it is known to be one that can be called through:
// this major, at least the 1.0 size, with create and destroy. Tests of
// behaviour start here; a plugin that fails these fails them all.
const meshrun_plugin_api& callable_api() {
  const OpenedPlugin& plugin = opened();
  INFO("plugin " << plugin_path << ": " << plugin.failure);
  REQUIRE(plugin.get_api != nullptr);
  const meshrun_plugin_api* api = plugin.get_api();
  REQUIRE(api != nullptr);
  REQUIRE(api->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_plugin_api, abi_minor));
  INFO("plugin ABI version " << api->abi_major << "." << api->abi_minor << ", supported "
                             << MESHRUN_ABI_VERSION_MAJOR << "." << MESHRUN_ABI_VERSION_MINOR_OLDEST
                             << " .. " << MESHRUN_ABI_VERSION_MAJOR << ".x");
  REQUIRE(api->abi_major == MESHRUN_ABI_VERSION_MAJOR);
  REQUIRE(api->struct_size >= MESHRUN_PLUGIN_API_SIZE_1_0);
  REQUIRE(api->create != nullptr);
  REQUIRE(api->destroy != nullptr);
  return *api;
}

// Checks an error the plugin returned (code, message, its own destroy) and
// releases it through that destroy. Without `expected_code`, any code of
// meshrun/error.h will do.
void check_and_release_error(meshrun_error* error, std::optional<int32_t> expected_code) {
  REQUIRE(error != nullptr);
  REQUIRE(error->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_error, destroy));
  REQUIRE(error->destroy != nullptr);
  REQUIRE(error->message != nullptr);
  const std::string message = error->message;
  INFO("error code " << error->code << ": " << message);
  const int32_t code = error->code;
  error->destroy(error);
  if (expected_code) {
    CHECK(code == *expected_code);
  } else {
    CHECK((code > MESHRUN_OK && code <= MESHRUN_DEADLINE_EXCEEDED));
  }
  CHECK(!message.empty());
}

// Bytes at the very end of a readable page, followed by an unreadable one: a
// plugin that reads past the struct_size it was given crashes here instead
// of passing by luck.
class GuardedBytes {
 public:
  explicit GuardedBytes(size_t bytes) : page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    void* base =
        mmap(nullptr, 2 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(base != MAP_FAILED);
    base_ = static_cast<unsigned char*>(base);
    REQUIRE(mprotect(base_ + page_, page_, PROT_NONE) == 0);
    data_ = base_ + page_ - bytes;
  }
  ~GuardedBytes() { munmap(base_, 2 * page_); }
  GuardedBytes(const GuardedBytes&) = delete;
  GuardedBytes& operator=(const GuardedBytes&) = delete;

  unsigned char* data() const { return data_; }

 private:
  size_t page_;
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
};

// The names of the symbols a shared library exports: defined, global or
// weak, default or protected visibility, in its dynamic symbol table.
std::vector<std::string> exported_symbols(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  const std::vector<char> file{std::istreambuf_iterator<char>(in),
                               std::istreambuf_iterator<char>()};
  const auto read = [&]<class T>(T& out, uint64_t offset) {
    REQUIRE(offset <= file.size());
    REQUIRE(sizeof(T) <= file.size() - offset);
    std::memcpy(&out, file.data() + offset, sizeof(T));
  };
  Elf64_Ehdr header;
  read(header, 0);
  REQUIRE(std::memcmp(header.e_ident, ELFMAG, SELFMAG) == 0);
  INFO("only 64-bit ELF plugins are checked");
  REQUIRE(header.e_ident[EI_CLASS] == ELFCLASS64);

  std::vector<std::string> names;
  for (uint16_t i = 0; i < header.e_shnum; ++i) {
    Elf64_Shdr section;
    read(section, header.e_shoff + uint64_t{i} * header.e_shentsize);
    if (section.sh_type != SHT_DYNSYM || section.sh_entsize == 0) continue;
    Elf64_Shdr strings;
    read(strings, header.e_shoff + uint64_t{section.sh_link} * header.e_shentsize);
    // Entry 0 is the reserved null symbol.
    for (uint64_t j = 1; j < section.sh_size / section.sh_entsize; ++j) {
      Elf64_Sym symbol;
      read(symbol, section.sh_offset + j * section.sh_entsize);
      const unsigned binding = ELF64_ST_BIND(symbol.st_info);
      const unsigned visibility = ELF64_ST_VISIBILITY(symbol.st_other);
      // SHN_ABS entries are version nodes of a version script, not code.
      if (symbol.st_shndx == SHN_UNDEF || symbol.st_shndx == SHN_ABS) continue;
      if (binding == STB_LOCAL) continue;
      if (visibility == STV_HIDDEN || visibility == STV_INTERNAL) continue;
      REQUIRE(symbol.st_name < strings.sh_size);
      const uint64_t offset = strings.sh_offset + symbol.st_name;
      REQUIRE(offset < file.size());
      names.emplace_back(file.data() + offset, strnlen(file.data() + offset, file.size() - offset));
    }
  }
  return names;
}

bool valid_plugin_name(const char* name) {
  if (name == nullptr || *name == '\0') return false;
  for (const char* c = name; *c != '\0'; ++c) {
    if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_')) return false;
  }
  return true;
}

// Walks an extension list, checking each node is well formed, and that a
// type nobody assigned is not found in it.
void check_extension_list(const meshrun_extension* list, const char* owner) {
  INFO("extension list of the " << owner);
  int count = 0;
  for (const meshrun_extension* node = list; node != nullptr; node = node->next) {
    REQUIRE(++count <= kMaxExtensions);
    CHECK(node->struct_size >= sizeof(meshrun_extension));
  }
  CHECK(meshrun_extension_find(list, kUnknownExtension) == nullptr);
}

TEST_CASE("exports its entry point", "[conformance]") {
  const OpenedPlugin& plugin = opened();
  INFO("plugin " << plugin_path << ": " << plugin.failure);
  CHECK(plugin.get_api != nullptr);
}

TEST_CASE("exports nothing but its entry point", "[conformance]") {
  const std::vector<std::string> names = exported_symbols(plugin_path);
  std::string list;
  for (const auto& name : names) list += " " + name;
  INFO("exported:" << list);
  CHECK(names == std::vector<std::string>{MESHRUN_PLUGIN_ENTRY_SYMBOL});
}

TEST_CASE("version query", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  INFO("plugin ABI version " << api.abi_major << "." << api.abi_minor);
  CHECK(opened().get_api() == &api);
  CHECK(api.abi_minor >= MESHRUN_ABI_VERSION_MINOR_OLDEST);
}

TEST_CASE("identity and kind table agree with the file name", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  const auto kind = static_cast<meshrun::PluginKind>(api.kind);
  const std::string kind_name(meshrun::plugin_kind_name(kind));
  INFO("kind " << api.kind);
  REQUIRE(meshrun::plugin_kind_from_name(kind_name).has_value());
  REQUIRE(valid_plugin_name(api.name));
  CHECK(std::filesystem::path(plugin_path).filename() ==
        "meshrun_" + kind_name + "_" + api.name + ".so");
  REQUIRE(api.version != nullptr);
  CHECK(*api.version != '\0');
  REQUIRE(api.description != nullptr);
  CHECK(*api.description != '\0');

  CHECK((api.strategy != nullptr) == (kind == meshrun::PluginKind::strategy));
  CHECK((api.schedule != nullptr) == (kind == meshrun::PluginKind::schedule));
  CHECK((api.sidecar != nullptr) == (kind == meshrun::PluginKind::sidecar));
  CHECK((api.comm != nullptr) == (kind == meshrun::PluginKind::comm));
  if (MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model)) {
    CHECK((api.model != nullptr) == (kind == meshrun::PluginKind::model));
  }
  switch (kind) {
    case meshrun::PluginKind::strategy:
      REQUIRE(api.strategy != nullptr);
      CHECK(api.strategy->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_strategy_api, extensions));
      CHECK(api.strategy->mesh_family >= MESHRUN_MESH_FAMILY_FSDP2);
      CHECK(api.strategy->mesh_family <= MESHRUN_MESH_FAMILY_DDP);
      // Only a sharded table (ABI 1.3 local_shard) starts shards by itself.
      if (api.strategy->struct_size >= MESHRUN_STRATEGY_API_SIZE_1_6 &&
          api.strategy->weights_by_shard != 0) {
        CHECK(api.strategy->local_shard != nullptr);
      }
      // A bfloat16 view (ABI 1.12) is a sharded table's, beside unit_views.
      if (api.strategy->struct_size >= MESHRUN_STRATEGY_API_SIZE_1_12 &&
          api.strategy->unit_views_bfloat16 != nullptr) {
        CHECK(api.strategy->unit_views != nullptr);
      }
      break;
    case meshrun::PluginKind::schedule:
      REQUIRE(api.schedule != nullptr);
      CHECK(api.schedule->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_schedule_api, extensions));
      CHECK(api.schedule->stages_per_rank >= 1);
      CHECK((api.schedule->placement == MESHRUN_PLACEMENT_LOOP ||
             api.schedule->placement == MESHRUN_PLACEMENT_V));
      CHECK((api.schedule->splits_backward == 0 || api.schedule->splits_backward == 1));
      break;
    case meshrun::PluginKind::sidecar:
      REQUIRE(api.sidecar != nullptr);
      CHECK(api.sidecar->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_sidecar_api, extensions));
      REQUIRE(api.sidecar->model_type != nullptr);
      CHECK(*api.sidecar->model_type != '\0');
      break;
    case meshrun::PluginKind::comm:
      REQUIRE(api.comm != nullptr);
      CHECK(api.comm->struct_size >= MESHRUN_STRUCT_SIZE(meshrun_comm_api, extensions));
      CHECK(api.comm->device_type >= 1);
      break;
    case meshrun::PluginKind::model:
      REQUIRE(MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model));
      REQUIRE(api.model != nullptr);
      CHECK(api.model->struct_size >= MESHRUN_MODEL_API_SIZE_1_5);
      REQUIRE(api.model->model_type != nullptr);
      CHECK(*api.model->model_type != '\0');
      break;
  }
}

TEST_CASE("the loader accepts it", "[conformance]") {
  try {
    meshrun::PluginLoader({}).load_file(plugin_path);
  } catch (const meshrun::Error& e) {
    FAIL(e.what());
  }
}

TEST_CASE("create with a NULL host returns INVALID_ARGUMENT", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  auto* const sentinel = reinterpret_cast<meshrun_plugin_instance*>(&plugin_path);
  meshrun_plugin_instance* out = sentinel;
  check_and_release_error(api.create(nullptr, &out), MESHRUN_INVALID_ARGUMENT);
  CHECK(out == sentinel);
}

TEST_CASE("create with a NULL out returns INVALID_ARGUMENT", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  check_and_release_error(api.create(&meshrun::host_services(), nullptr), MESHRUN_INVALID_ARGUMENT);
}

TEST_CASE("a host services table too small is refused without reading past it", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  const size_t struct_size = sizeof(size_t);
  GuardedBytes host(struct_size);
  std::memcpy(host.data(), &struct_size, sizeof struct_size);
  meshrun_plugin_instance* out = nullptr;
  check_and_release_error(
      api.create(reinterpret_cast<const meshrun_host_services*>(host.data()), &out),
      MESHRUN_INVALID_ARGUMENT);
  CHECK(out == nullptr);
}

TEST_CASE("a host services table larger than known is accepted", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  struct LargerHost {
    meshrun_host_services known;
    unsigned char added_later[64];
  } host{};
  host.known = meshrun::host_services();
  host.known.struct_size = sizeof(LargerHost);
  meshrun_plugin_instance* out = nullptr;
  meshrun_error* error = api.create(&host.known, &out);
  INFO((error != nullptr && error->message != nullptr ? error->message : ""));
  CHECK(error == nullptr);
  meshrun_error_release(error);
  api.destroy(out);
}

TEST_CASE("destroy accepts NULL", "[conformance]") { callable_api().destroy(nullptr); }

TEST_CASE("instances can be created and destroyed repeatedly", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  for (int round = 0; round < 2; ++round) {
    meshrun_plugin_instance* first = nullptr;
    meshrun_plugin_instance* second = nullptr;
    REQUIRE(api.create(&meshrun::host_services(), &first) == nullptr);
    REQUIRE(api.create(&meshrun::host_services(), &second) == nullptr);
    {
      INFO("create succeeded but returned no instance");
      CHECK(first != nullptr);
      CHECK(second != nullptr);
    }
    CHECK(first != second);
    api.destroy(second);
    api.destroy(first);
  }
}

TEST_CASE("a schedule's generate refuses bad arguments and returns actions the host frees",
          "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (api.schedule == nullptr || !MESHRUN_HAS_FIELD(meshrun_schedule_api, api.schedule, generate) ||
      api.schedule->generate == nullptr) {
    SUCCEED("no generate entry (a schedule table before ABI 1.4, or another kind)");
    return;
  }
  const meshrun_schedule_api& schedule = *api.schedule;
  const meshrun_host_services& host = meshrun::host_services();
  meshrun_plugin_instance* instance = nullptr;
  REQUIRE(api.create(&host, &instance) == nullptr);
  char* const sentinel = reinterpret_cast<char*>(&plugin_path);
  char* out = sentinel;
  const int64_t v = schedule.stages_per_rank;
  check_and_release_error(schedule.generate(nullptr, 2, v, 8, "{}", &out),
                          MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(schedule.generate(instance, 2, v, 8, "{}", nullptr),
                          MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(schedule.generate(instance, 0, v, 8, "{}", &out),
                          MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(schedule.generate(instance, 2, v, 8, "[", &out),
                          MESHRUN_INVALID_ARGUMENT);
  CHECK(out == sentinel);
  // Its own defaults, with 8 microbatches (a multiple of pp, at least 2 pp).
  meshrun_error* error = schedule.generate(instance, 2, v, 8, nullptr, &out);
  INFO((error != nullptr && error->message != nullptr ? error->message : ""));
  REQUIRE(error == nullptr);
  REQUIRE(out != sentinel);
  REQUIRE(out != nullptr);
  CHECK(std::string(out).rfind("{", 0) == 0);
  host.deallocate(host.context, out);
  api.destroy(instance);
}

// Host services that remember the blocks they allocate and their sizes
// (`context` points to the record), so that a string a plugin returns can be
// checked to be one of them, NUL-terminated within it.
using AllocatedBlocks = std::map<const void*, size_t>;

void* recording_allocate(void* context, size_t bytes, size_t alignment) {
  const meshrun_host_services& host = meshrun::host_services();
  void* block = host.allocate(host.context, bytes, alignment);
  if (block != nullptr) (*static_cast<AllocatedBlocks*>(context))[block] = bytes;
  return block;
}

void recording_deallocate(void* context, void* pointer) {
  static_cast<AllocatedBlocks*>(context)->erase(pointer);
  const meshrun_host_services& host = meshrun::host_services();
  host.deallocate(host.context, pointer);
}

meshrun_host_services recording_host(AllocatedBlocks& blocks) {
  meshrun_host_services host = meshrun::host_services();
  host.context = &blocks;
  host.allocate = &recording_allocate;
  host.deallocate = &recording_deallocate;
  return host;
}

// A request with the fields docs/plan.md gives, for a small Llama-shaped
// model of the sidecar's model type on one rank: one layer of one matrix.
std::string minimal_plan_request(const char* model_type) {
  const nlohmann::json config = {{"model_type", model_type},    {"vocab_size", 128},
                                 {"hidden_size", 64},           {"num_hidden_layers", 1},
                                 {"num_attention_heads", 4},    {"num_key_value_heads", 2},
                                 {"tie_word_embeddings", false}};
  const nlohmann::json parameter = {
      {"name", "model.layers.0.w"}, {"shape", {64, 64}}, {"unit", "model.layers.0"}};
  nlohmann::json placed = parameter;
  placed["tp"] = "replicate";
  placed["local_shape"] = {64, 64};
  return nlohmann::json{
      {"model", config},
      {"description",
       {{"config", config},
        {"parameters", {parameter}},
        {"units", {"model.layers.0", "root"}},
        {"modules", {{{"name", "model.layers.0"}, {"parameters", {"model.layers.0.w"}}}}},
        {"vocab_size", 128}}},
      {"default_plan",
       {{"units",
         {{{"name", "root"}, {"parameters", nlohmann::json::array()}},
          {{"name", "model.layers.0"}, {"parameters", {"model.layers.0.w"}}}}},
        {"parameters", {placed}},
        {"tensor_parallel", nlohmann::json::array()},
        {"pipeline", nullptr},
        {"activation_checkpointing", nlohmann::json::array()}}},
      {"mesh", {{"pp", 1}, {"dp_replicate", 1}, {"dp_shard", 1}, {"cp", 1}, {"tp", 1}, {"ep", 1}}},
      {"sequence_parallel", false},
      {"activation_checkpointing", ""},
      {"pipeline", nlohmann::json::object()}}
      .dump();
}

TEST_CASE("a sidecar's plan refuses bad arguments and returns a plan the host frees",
          "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (api.sidecar == nullptr || !MESHRUN_HAS_FIELD(meshrun_sidecar_api, api.sidecar, plan) ||
      api.sidecar->plan == nullptr) {
    SUCCEED("no plan entry (a sidecar table before ABI 1.2, or another kind)");
    return;
  }
  const meshrun_sidecar_api& sidecar = *api.sidecar;
  AllocatedBlocks blocks;
  const meshrun_host_services host = recording_host(blocks);
  meshrun_plugin_instance* instance = nullptr;
  REQUIRE(api.create(&host, &instance) == nullptr);
  const std::string request = minimal_plan_request(sidecar.model_type);
  char* const sentinel = reinterpret_cast<char*>(&plugin_path);
  char* out = sentinel;
  check_and_release_error(sidecar.plan(nullptr, request.c_str(), &out), MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(sidecar.plan(instance, nullptr, &out), MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(sidecar.plan(instance, request.c_str(), nullptr),
                          MESHRUN_INVALID_ARGUMENT);
  {
    INFO("a request that is not JSON");
    check_and_release_error(sidecar.plan(instance, "{\"model\": [", &out), std::nullopt);
  }
  CHECK(out == sentinel);
  meshrun_error* error = sidecar.plan(instance, request.c_str(), &out);
  if (error != nullptr) {
    // A sidecar for another family may refuse a Llama-shaped model.
    check_and_release_error(error, std::nullopt);
    CHECK(out == sentinel);
  } else {
    REQUIRE(out != sentinel);
    REQUIRE(out != nullptr);
    const auto block = blocks.find(out);
    {
      INFO("the plan must be allocated with the host services' allocate, NUL-terminated");
      REQUIRE(block != blocks.end());
      REQUIRE(std::memchr(out, '\0', block->second) != nullptr);
    }
    const std::string text = out;
    host.deallocate(host.context, out);
    INFO("plan: " << text);
    const nlohmann::json plan = nlohmann::json::parse(text, nullptr, false);
    REQUIRE_FALSE(plan.is_discarded());
    REQUIRE(plan.is_object());
    INFO("the plan's units must be an array");
    CHECK((plan.contains("units") && plan["units"].is_array()));
  }
  api.destroy(instance);
}

// The host side of a model stage as a replicated strategy gives it: every
// parameter in one flat buffer, each announcement counted.
class FlatHooks : public meshrun::StageHooks {
 public:
  explicit FlatHooks(const meshrun::ModelDescription& d)
      : d_(d), values(size_t(d.numel)), gradients(size_t(d.numel)), ready(d.parameters.size()) {}
  meshrun::ParameterStorage parameter(int64_t p, bool backward) override {
    const int64_t offset = d_.parameters[size_t(p)].offset;
    return {values.data() + offset, backward ? gradients.data() + offset : nullptr};
  }
  void gradient_ready(int64_t p) override { ++ready[size_t(p)]; }

  const meshrun::ModelDescription& d_;
  std::vector<float> values, gradients;
  std::vector<int> ready;
};

// The model of the plugin's defaults (an empty [model] table): every model
// must take it, each key having a default.
std::unique_ptr<meshrun::Model> default_model() {
  try {
    return std::make_unique<meshrun::Model>(meshrun::PluginLoader({}).load_file(plugin_path),
                                            nlohmann::ordered_json::object());
  } catch (const meshrun::Error& e) {
    FAIL("the model of an empty [model] table: " << e.what());
  }
  return nullptr;
}

// Whether the model's description lists "cuda" among its devices.
bool computes_on_cuda(const meshrun::Model& model) {
  const std::vector<std::string>& devices = model.description().devices;
  return std::find(devices.begin(), devices.end(), "cuda") != devices.end();
}

TEST_CASE("a model's entry points refuse NULL with INVALID_ARGUMENT", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (!MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model) || api.model == nullptr) {
    SUCCEED("not a model plugin");
    return;
  }
  const meshrun_model_api& model = *api.model;
  const meshrun_host_services& host = meshrun::host_services();
  meshrun_plugin_instance* instance = nullptr;
  REQUIRE(api.create(&host, &instance) == nullptr);
  auto* const sentinel = reinterpret_cast<meshrun_model*>(&plugin_path);
  meshrun_model* out = sentinel;
  check_and_release_error(model.model_create(nullptr, "{}", &out), MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(model.model_create(instance, nullptr, &out), MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(model.model_create(instance, "{}", nullptr), MESHRUN_INVALID_ARGUMENT);
  {
    INFO("a config that is not JSON");
    check_and_release_error(model.model_create(instance, "{\"a\": [", &out), std::nullopt);
  }
  CHECK(out == sentinel);
  REQUIRE(model.model_create(instance, "{}", &out) == nullptr);
  REQUIRE(out != sentinel);
  check_and_release_error(model.describe(out, nullptr), MESHRUN_INVALID_ARGUMENT);
  check_and_release_error(model.describe(nullptr, nullptr), MESHRUN_INVALID_ARGUMENT);
  meshrun_model_stage* stage = nullptr;
  check_and_release_error(model.stage_create(out, nullptr, &stage), MESHRUN_INVALID_ARGUMENT);
  CHECK(stage == nullptr);
  int64_t bytes = 0;
  check_and_release_error(model.activation_bytes(nullptr, &bytes), MESHRUN_INVALID_ARGUMENT);
  model.stage_destroy(nullptr);
  model.model_destroy(nullptr);
  model.model_destroy(out);
  api.destroy(instance);
}

// A stage setup on a device the model does not compute on (its
// description's "devices", ABI 1.14's setup.device) is refused by
// stage_create with UNIMPLEMENTED, before any hook is called, and no stage
// is made.
TEST_CASE("a model refuses a stage on a device it does not compute on", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (!MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model) || api.model == nullptr) {
    SUCCEED("not a model plugin");
    return;
  }
  const auto model = default_model();
  if (computes_on_cuda(*model)) {
    SUCCEED("the model computes on CUDA");
    return;
  }
  const RawStageSetup on_gpu(*model, DLDevice{kDLCUDA, 0});
  meshrun_model_stage* stage = nullptr;
  check_and_release_error(model->api().stage_create(model->handle(), &on_gpu.setup, &stage),
                          MESHRUN_UNIMPLEMENTED);
  CHECK(stage == nullptr);
}

// A model that computes on CUDA refuses a stage on a GPU this process does
// not have (no machine has 1000), naming the device, before any hook is
// called; where its GPU compute has no usable device at all it says so.
TEST_CASE("a model on CUDA refuses a device the process lacks, naming it", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (!MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model) || api.model == nullptr) {
    SUCCEED("not a model plugin");
    return;
  }
  const auto model = default_model();
  if (!computes_on_cuda(*model)) {
    SUCCEED("the model computes on the CPU only");
    return;
  }
  const RawStageSetup on_gpu(*model, DLDevice{kDLCUDA, 1000});
  meshrun_model_stage* stage = nullptr;
  meshrun_error* error = model->api().stage_create(model->handle(), &on_gpu.setup, &stage);
  REQUIRE(error != nullptr);
  CHECK((error->code == MESHRUN_OUT_OF_RANGE || error->code == MESHRUN_UNAVAILABLE));
  CHECK_THAT(std::string(error->message), Catch::Contains("cuda:1000"));
  meshrun_error_release(error);
  CHECK(stage == nullptr);
}

// One micro-batch through a stage of the whole model, as the trainer runs it:
// the description holds together, every parameter is initialized the same
// for the same seed, the hooks come in the documented order (the host
// checks), every parameter's gradient is announced once, and nothing is
// kept after the backward.
TEST_CASE("a model computes a micro-batch over the host's hooks", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  if (!MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model) || api.model == nullptr) {
    SUCCEED("not a model plugin");
    return;
  }
  const auto model = default_model();
  const meshrun::ModelDescription& d = model->description();
  FlatHooks hooks(d);
  model->init_parameters(7, hooks.values.data());
  std::vector<float> again(size_t(d.numel));
  model->init_parameters(7, again.data());
  CHECK(again == hooks.values);
  CHECK(std::all_of(again.begin(), again.end(), [](float v) { return std::isfinite(v); }));

  std::vector<std::string> modules;
  for (const auto& module : d.modules) modules.push_back(module.name);
  meshrun::ModelStage stage(*model, modules, hooks, {}, "{}", "{}");
  const int64_t batch = 2, seq_len = std::min<int64_t>(4, d.max_seq_len.value_or(4));
  stage.set_shape(batch, seq_len);
  CHECK(stage.input_numel() == 0);
  CHECK(stage.output_numel() == 0);
  std::vector<int32_t> tokens(size_t(batch * seq_len)), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 7) % size_t(d.vocab_size));
    targets[i] = int32_t((i * 5 + 1) % size_t(d.vocab_size));
  }
  try {
    const double loss = stage.forward(0, tokens.data(), targets.data(), nullptr, nullptr);
    CHECK(std::isfinite(loss));
    CHECK(loss > 0);
    CHECK(stage.activation_bytes() > 0);
    stage.backward(0, 1.0f, nullptr, nullptr);
  } catch (const meshrun::Error& e) {
    FAIL(e.what());
  }
  CHECK(stage.activation_bytes() == 0);
  for (size_t p = 0; p < d.parameters.size(); ++p) {
    INFO("gradient_ready of " << d.parameters[p].name);
    CHECK(hooks.ready[p] == 1);
  }
  CHECK(
      std::any_of(hooks.gradients.begin(), hooks.gradients.end(), [](float g) { return g != 0; }));
  CHECK_THROWS_AS(stage.backward(0, 1.0f, nullptr, nullptr), meshrun::Error);
}

TEST_CASE("an unknown extension is absent, and the host reports UNIMPLEMENTED", "[conformance]") {
  const meshrun_plugin_api& api = callable_api();
  check_extension_list(api.extensions, "plugin table");
  if (api.strategy != nullptr) check_extension_list(api.strategy->extensions, "strategy table");
  if (api.schedule != nullptr) check_extension_list(api.schedule->extensions, "schedule table");
  if (api.sidecar != nullptr) check_extension_list(api.sidecar->extensions, "sidecar table");
  if (api.comm != nullptr) check_extension_list(api.comm->extensions, "comm table");

  const auto library = meshrun::PluginLoader({}).load_file(plugin_path);
  try {
    meshrun::require_extension(*library, library->api().extensions, kUnknownExtension,
                               "a feature nobody defined");
    FAIL("require_extension found an extension of a type nobody assigned");
  } catch (const meshrun::Error& e) {
    CHECK(e.code() == MESHRUN_UNIMPLEMENTED);
  }
}

}  // namespace

int main(int argc, char* argv[]) {
  // --plugin FILE is the suite's own option; every other argument is Catch2's.
  std::vector<char*> catch_arguments{argv[0]};
  bool listing = false;  // help or a list, which need no plugin
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--plugin" && i + 1 < argc) {
      plugin_path = argv[++i];
      continue;
    }
    if (argument.rfind("--plugin=", 0) == 0) {
      plugin_path = argument.substr(std::string("--plugin=").size());
      continue;
    }
    if (argument == "-h" || argument == "-?" || argument == "--help" || argument == "-l" ||
        argument == "-t" || argument.rfind("--list", 0) == 0) {
      listing = true;
    }
    catch_arguments.push_back(argv[i]);
  }
  if (plugin_path.empty()) {
    if (const char* env = std::getenv("MESHRUN_CONFORMANCE_PLUGIN")) plugin_path = env;
  }
  if (listing) {
    std::puts(
        "meshrun-conformance --plugin FILE [Catch2 options]: checks one plugin file against "
        "meshrun's ABI rules (FILE defaults to $MESHRUN_CONFORMANCE_PLUGIN)");
  } else if (plugin_path.empty()) {
    std::fprintf(stderr,
                 "meshrun-conformance: name the plugin to check with --plugin FILE "
                 "(or MESHRUN_CONFORMANCE_PLUGIN=FILE)\n");
    return 2;
  }
  return meshrun::testing::run_catch_session(static_cast<int>(catch_arguments.size()),
                                             catch_arguments.data());
}
