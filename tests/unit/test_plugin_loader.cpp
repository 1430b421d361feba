// The plugin loader: one test per way a plugin file can fail to load (each
// asserting that the message names the file and the reason), loading by
// name, shadowing, MESHRUN_PLUGIN_PATH, listing, instances and the host
// services. The test plugins come from tests/plugins/ (MESHRUN_TEST_PLUGIN_DIR),
// the shipped ones from this build's plugin folder (MESHRUN_SHIPPED_PLUGIN_DIR).
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.hpp"
#include "plugin/loader.hpp"
#include "temp_folder.hpp"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using meshrun::PluginKind;
using meshrun::PluginLoader;

namespace {

const std::string kTestDir = MESHRUN_TEST_PLUGIN_DIR;
const std::string kShippedDir = MESHRUN_SHIPPED_PLUGIN_DIR;

// The extension through which the create_fails test plugin publishes how many
// of its errors were destroyed (see tests/plugins/test_plugin.cpp).
constexpr int32_t kErrorCounterExtension = 0x7e57;
struct ErrorCounter {
  meshrun_extension header;
  const int32_t* destroyed_errors;
};

std::string test_plugin(const std::string& name, const std::string& kind = "strategy") {
  return kTestDir + "/meshrun_" + kind + "_" + name + ".so";
}

// A fresh directory to copy plugins into, removed afterwards.
class TempDir : public TempFolder {
 public:
  TempDir() : TempFolder("meshrun-plugin-test") {}
  std::string add(const std::string& from, const std::string& file_name) const {
    const std::string to = file(file_name);
    fs::copy_file(from, to);
    return to;
  }
};

// Sets an environment variable for one scope and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

template <class Body>
meshrun::Error error_from(Body&& body) {
  try {
    body();
  } catch (const meshrun::Error& e) {
    return e;
  }
  FAIL("no meshrun::Error was thrown");
  throw std::logic_error("unreachable");
}

meshrun::Error load_error(const std::string& path, meshrun::VersionPolicy policy = {}) {
  return error_from([&] { PluginLoader({}, policy).load_file(path); });
}

bool same_file(const std::string& a, const std::string& b) {
  return fs::weakly_canonical(a) == fs::weakly_canonical(b);
}

}  // namespace

TEST_CASE("plugin loader: kind names", "[plugin]") {
  CHECK(meshrun::plugin_kind_names() ==
        std::vector<std::string>{"strategy", "schedule", "sidecar", "comm", "model"});
  for (const auto& name : meshrun::plugin_kind_names()) {
    const auto kind = meshrun::plugin_kind_from_name(name);
    REQUIRE(kind.has_value());
    CHECK(meshrun::plugin_kind_name(*kind) == name);
  }
  CHECK_FALSE(meshrun::plugin_kind_from_name("strategies").has_value());
}

TEST_CASE("plugin loader: a missing file is NOT_FOUND", "[plugin]") {
  const std::string path = kTestDir + "/meshrun_strategy_nowhere.so";
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_NOT_FOUND);
  CHECK_THAT(error.what(), Contains(path) && Contains("does not exist"));
}

TEST_CASE("plugin loader: a file name not meshrun_<kind>_<name>.so is refused", "[plugin]") {
  TempDir dir;
  const std::string basic = test_plugin("basic");
  const std::string odd = dir.add(basic, "libbasic.so");
  auto error = load_error(odd);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(odd) && Contains("does not follow meshrun_<kind>_<name>.so"));

  const std::string misspelled = dir.add(basic, "meshrun_stratgy_basic.so");
  error = load_error(misspelled);
  CHECK_THAT(error.what(), Contains(misspelled) && Contains("unknown plugin kind 'stratgy'") &&
                               Contains("did you mean 'strategy'"));
}

TEST_CASE("plugin loader: a file dlopen refuses is reported with dlopen's reason", "[plugin]") {
  TempDir dir;
  const std::string path = dir.path() + "/meshrun_strategy_garbage.so";
  std::ofstream(path) << "not a shared library\n";
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  // dlerror() names the file too, and says why (for this file: not ELF).
  CHECK_THAT(error.what(), Contains("plugin " + path + ": cannot be loaded: " + path));
}

TEST_CASE("plugin loader: a library without the entry symbol is refused", "[plugin]") {
  const std::string path = test_plugin("noentry");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(path) && Contains("no meshrun_plugin_get_api symbol"));
}

TEST_CASE("plugin loader: a NULL table is refused", "[plugin]") {
  const std::string path = test_plugin("null_table");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(path) && Contains("meshrun_plugin_get_api() returned NULL"));
}

TEST_CASE("plugin loader: a table smaller than ABI 1.0 is refused", "[plugin]") {
  const std::string path = test_plugin("too_small");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(),
             Contains(path) &&
                 Contains("plugin table too small: struct_size " +
                          std::to_string(MESHRUN_STRUCT_SIZE(meshrun_plugin_api, description)) +
                          " < " + std::to_string(MESHRUN_PLUGIN_API_SIZE_1_0)));
}

TEST_CASE("plugin loader: another major version is refused with the supported range", "[plugin]") {
  const std::string path = test_plugin("wrong_major");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_VERSION_MISMATCH);
  CHECK_THAT(error.what(), Contains(path) && Contains("ABI version 2.0 is another major version") &&
                               Contains("(supported: 1.0 .. 1.x)"));
}

TEST_CASE("plugin loader: a minor older than the oldest supported is refused", "[plugin]") {
  const std::string path = test_plugin("basic");
  // The test plugin declares the current minor; a host that needs one more refuses it.
  constexpr int32_t current = MESHRUN_ABI_VERSION_MINOR;
  const auto error = load_error(path, meshrun::VersionPolicy{1, current + 1});
  CHECK(error.code() == MESHRUN_VERSION_MISMATCH);
  CHECK_THAT(error.what(),
             Contains(path) &&
                 Contains("ABI version 1." + std::to_string(current) +
                          " is older than the oldest supported") &&
                 Contains("(supported: 1." + std::to_string(current + 1) + " .. 1.x)"));
  CHECK_NOTHROW(PluginLoader({}, meshrun::VersionPolicy{1, current}).load_file(path));
}

TEST_CASE("plugin loader: a newer minor with larger tables is accepted", "[plugin]") {
  const auto library = PluginLoader({}).load_file(test_plugin("newer_minor"));
  CHECK(library->api().abi_minor == MESHRUN_ABI_VERSION_MINOR + 7);
  CHECK(library->api().struct_size > MESHRUN_PLUGIN_API_SIZE_1_0);
  CHECK(library->api().strategy->struct_size > sizeof(meshrun_strategy_api));
  const meshrun::PluginInstance instance(library);
  CHECK(instance.handle() != nullptr);
}

TEST_CASE("plugin loader: an unknown kind is refused", "[plugin]") {
  const std::string path = test_plugin("unknown_kind");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(path) && Contains("declares unknown plugin kind 42"));
}

TEST_CASE("plugin loader: a kind that disagrees with the file name is refused", "[plugin]") {
  const std::string path = test_plugin("kind_mismatch", "schedule");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(path) && Contains("declares kind 'strategy' but its file "
                                                      "name says 'schedule'"));
}

TEST_CASE("plugin loader: a name that disagrees with the file name is refused", "[plugin]") {
  const std::string path = test_plugin("name_mismatch");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains(path) && Contains("declares name 'another_name' but its file "
                                                      "name says 'name_mismatch'"));
}

TEST_CASE("plugin loader: a missing kind table is refused", "[plugin]") {
  const std::string path = test_plugin("no_kind_table");
  const auto error = load_error(path);
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(),
             Contains(path) && Contains("is a strategy plugin but its strategy table is NULL"));
}

TEST_CASE("plugin loader: a plugin of another kind or name than asked for is refused", "[plugin]") {
  const std::string path = test_plugin("basic");
  auto error = error_from([&] { PluginLoader({}).load_file(path, PluginKind::schedule); });
  CHECK_THAT(error.what(),
             Contains(path) && Contains("is a strategy plugin, not a schedule plugin"));
  error = error_from([&] { PluginLoader({}).load_file(path, PluginKind::strategy, "ddp"); });
  CHECK_THAT(error.what(), Contains(path) && Contains("is named 'basic', not 'ddp'"));
}

TEST_CASE("plugin loader: a failing create carries the plugin's code and message", "[plugin]") {
  const PluginLoader loader({kTestDir});
  const auto library = loader.load(PluginKind::strategy, "create_fails");
  const auto& counter = reinterpret_cast<const ErrorCounter&>(meshrun::require_extension(
      *library, library->api().extensions, kErrorCounterExtension, "error counter"));
  const int32_t destroyed_before = *counter.destroyed_errors;

  const auto error = error_from([&] { meshrun::PluginInstance instance(library); });
  CHECK(error.code() == MESHRUN_UNAVAILABLE);
  CHECK_THAT(error.what(), Contains(library->path()) && Contains("create failed") &&
                               Contains("test plugin: no device available"));
  // Released exactly once, through the plugin's own destroy.
  CHECK(*counter.destroyed_errors == destroyed_before + 1);
}

TEST_CASE("plugin loader: a create that succeeds without an instance is refused", "[plugin]") {
  const auto library = PluginLoader({kTestDir}).load(PluginKind::strategy, "null_instance");
  const auto error = error_from([&] { meshrun::PluginInstance instance(library); });
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
  CHECK_THAT(error.what(), Contains("plugin " + library->path() + ": ") &&
                               Contains("create succeeded but returned no instance"));
}

TEST_CASE("plugin loader: shipped plugins load by name", "[plugin]") {
  const PluginLoader loader({kShippedDir});
  CHECK(loader.available(PluginKind::strategy) ==
        std::vector<std::string>{"ddp", "fsdp2", "megatron_fsdp"});
  CHECK(loader.available(PluginKind::schedule) ==
        std::vector<std::string>{"1f1b", "dualpipev", "gpipe", "interleaved_1f1b",
                                 "interleaved_zero_bubble", "looped_bfs", "zbv_zero_bubble"});
  CHECK(loader.available(PluginKind::sidecar) == std::vector<std::string>{"llama"});

  const std::map<std::string, int32_t> families = {
      {"ddp", MESHRUN_MESH_FAMILY_DDP},
      {"fsdp2", MESHRUN_MESH_FAMILY_FSDP2},
      {"megatron_fsdp", MESHRUN_MESH_FAMILY_MEGATRON_FSDP}};
  for (const auto& [name, family] : families) {
    const auto library = loader.load(PluginKind::strategy, name);
    CHECK(library->name() == name);
    CHECK(library->kind() == PluginKind::strategy);
    CHECK(library->api().strategy->mesh_family == family);
    CHECK(same_file(library->path(), kShippedDir + "/meshrun_strategy_" + name + ".so"));
    const meshrun::PluginInstance instance(library);
  }

  struct ScheduleFacts {
    int32_t stages_per_rank;
    int32_t placement;
    int32_t splits_backward;
  };
  const std::map<std::string, ScheduleFacts> schedules = {
      {"gpipe", {1, MESHRUN_PLACEMENT_LOOP, 0}},
      {"1f1b", {1, MESHRUN_PLACEMENT_LOOP, 0}},
      {"interleaved_1f1b", {2, MESHRUN_PLACEMENT_LOOP, 0}},
      {"looped_bfs", {2, MESHRUN_PLACEMENT_LOOP, 0}},
      {"interleaved_zero_bubble", {2, MESHRUN_PLACEMENT_LOOP, 1}},
      {"zbv_zero_bubble", {2, MESHRUN_PLACEMENT_V, 1}},
      {"dualpipev", {2, MESHRUN_PLACEMENT_V, 1}},
  };
  for (const auto& [name, facts] : schedules) {
    INFO("schedule " << name);
    const auto library = loader.load(PluginKind::schedule, name);
    const meshrun_schedule_api& table = *library->api().schedule;
    CHECK(table.stages_per_rank == facts.stages_per_rank);
    CHECK(table.placement == facts.placement);
    CHECK(table.splits_backward == facts.splits_backward);
  }

  const auto llama = loader.load(PluginKind::sidecar, "llama");
  CHECK(std::string(llama->api().sidecar->model_type) == "llama");
}

TEST_CASE("plugin loader: an unknown name lists the names there are and where it looked",
          "[plugin]") {
  const PluginLoader loader({kShippedDir, kTestDir});
  const auto error = error_from([&] { loader.load(PluginKind::strategy, "fsdp"); });
  CHECK(error.code() == MESHRUN_NOT_FOUND);
  CHECK_THAT(error.what(), Contains("no strategy plugin named 'fsdp' (did you mean 'fsdp2'?)") &&
                               Contains("ddp, fsdp2, megatron_fsdp") &&
                               Contains(kShippedDir + ", " + kTestDir));

  TempDir empty;
  const auto none = error_from([&] { PluginLoader({empty.path()}).load(PluginKind::comm, "mpi"); });
  CHECK_THAT(none.what(), Contains("available: none") && Contains(empty.path()));
  const auto bad_name =
      error_from([&] { PluginLoader({kTestDir}).load(PluginKind::strategy, "../basic"); });
  CHECK(bad_name.code() == MESHRUN_NOT_FOUND);
}

TEST_CASE("plugin loader: an earlier directory shadows a later one", "[plugin]") {
  TempDir first;
  TempDir second;
  const std::string winner = first.add(test_plugin("basic"), "meshrun_strategy_basic.so");
  const std::string shadowed = second.add(test_plugin("basic"), "meshrun_strategy_basic.so");
  second.add(test_plugin("plain_c", "schedule"), "meshrun_schedule_plain_c.so");
  const PluginLoader loader({first.path(), second.path()});

  CHECK(loader.find(PluginKind::strategy, "basic") == winner);
  CHECK(loader.load(PluginKind::strategy, "basic")->path() == winner);
  CHECK(loader.available(PluginKind::strategy) == std::vector<std::string>{"basic"});

  const auto rows = loader.list();
  REQUIRE(rows.size() == 3);
  CHECK(rows[0].path == winner);
  CHECK_FALSE(rows[0].shadowed);
  CHECK(rows[1].path == std::string(second.path() + "/meshrun_schedule_plain_c.so"));
  CHECK_FALSE(rows[1].shadowed);
  CHECK(rows[2].path == shadowed);
  CHECK(rows[2].shadowed);
}

TEST_CASE("plugin loader: MESHRUN_PLUGIN_PATH follows the build's plugin folder", "[plugin]") {
  TempDir first;
  TempDir second;
  first.add(test_plugin("basic"), "meshrun_strategy_basic.so");
  second.add(test_plugin("plain_c", "schedule"), "meshrun_schedule_plain_c.so");
  // An empty entry is skipped and the plugin folder is not searched twice.
  const ScopedEnv env("MESHRUN_PLUGIN_PATH",
                      first.path() + "::" + kShippedDir + ":" + second.path());
  const PluginLoader loader = PluginLoader::from_environment();

  REQUIRE(loader.search_path().size() == 3);
  CHECK(same_file(loader.search_path()[0], kShippedDir));
  CHECK(loader.search_path()[1] == first.path());
  CHECK(loader.search_path()[2] == second.path());
  CHECK(loader.load(PluginKind::strategy, "ddp")->path() ==
        loader.search_path()[0] + "/meshrun_strategy_ddp.so");
  CHECK(loader.load(PluginKind::strategy, "basic")->path() ==
        first.path() + "/meshrun_strategy_basic.so");
  CHECK(loader.load(PluginKind::schedule, "plain_c")->path() ==
        second.path() + "/meshrun_schedule_plain_c.so");
}

TEST_CASE("plugin loader: without MESHRUN_PLUGIN_PATH only the plugin folder is searched",
          "[plugin]") {
  const ScopedEnv env("MESHRUN_PLUGIN_PATH", "");
  const PluginLoader loader = PluginLoader::from_environment();
  REQUIRE(loader.search_path().size() == 1);
  CHECK(same_file(loader.search_path()[0], kShippedDir));
}

TEST_CASE("plugin loader: listing shows every file with its version or its error", "[plugin]") {
  const PluginLoader loader({kTestDir});
  std::map<std::string, meshrun::PluginInfo> by_name;
  for (auto& row : loader.list()) by_name[row.name] = row;

  const auto& basic = by_name.at("basic");
  CHECK(basic.kind == "strategy");
  CHECK(basic.abi_major == 1);
  CHECK(basic.abi_minor == MESHRUN_ABI_VERSION_MINOR);
  CHECK(basic.version == "0.0.1-test");
  CHECK(basic.description == "loader test plugin: basic");
  CHECK(basic.error.empty());
  CHECK_FALSE(basic.shadowed);

  CHECK_THAT(by_name.at("wrong_major").error,
             Contains(test_plugin("wrong_major")) && Contains("ABI version 2.0"));
  CHECK_THAT(by_name.at("noentry").error, Contains("no meshrun_plugin_get_api symbol"));
  CHECK(by_name.at("kind_mismatch").kind == "schedule");
  CHECK_FALSE(by_name.at("kind_mismatch").error.empty());

  std::vector<std::string> schedules;
  for (const auto& row : loader.list(PluginKind::schedule)) schedules.push_back(row.name);
  CHECK(schedules == std::vector<std::string>{"kind_mismatch", "plain_c"});
}

TEST_CASE("plugin loader: a plugin written in plain C loads and makes instances", "[plugin]") {
  const auto library = PluginLoader({kTestDir}).load(PluginKind::schedule, "plain_c");
  CHECK(library->api().schedule->placement == MESHRUN_PLACEMENT_LOOP);
  const meshrun::PluginInstance first(library);
  const meshrun::PluginInstance second(library);
  CHECK(first.handle() != nullptr);
  CHECK(first.handle() != second.handle());
}

TEST_CASE("plugin loader: an instance needs a library", "[plugin]") {
  const auto error = error_from([] { meshrun::PluginInstance instance(nullptr); });
  CHECK(error.code() == MESHRUN_INVALID_ARGUMENT);
}

TEST_CASE("plugin loader: a missing extension is UNIMPLEMENTED", "[plugin]") {
  const auto library = PluginLoader({}).load_file(test_plugin("basic"));
  const auto error = error_from([&] {
    meshrun::require_extension(*library, library->api().extensions, 12345, "frobnication");
  });
  CHECK(error.code() == MESHRUN_UNIMPLEMENTED);
  CHECK_THAT(error.what(), Contains(library->path()) &&
                               Contains("does not implement frobnication (extension type 12345)"));
}

TEST_CASE("plugin loader: host services", "[plugin]") {
  const meshrun_host_services& host = meshrun::host_services();
  CHECK(host.struct_size >= MESHRUN_HOST_SERVICES_SIZE_1_0);
  CHECK(host.abi_major == MESHRUN_ABI_VERSION_MAJOR);
  CHECK(host.abi_minor == MESHRUN_ABI_VERSION_MINOR);

  meshrun_error* error = host.make_error(host.context, MESHRUN_OUT_OF_RANGE, "rank 9 of 8");
  REQUIRE(error != nullptr);
  CHECK(error->code == MESHRUN_OUT_OF_RANGE);
  CHECK(std::string(error->message) == "rank 9 of 8");
  meshrun_error_release(error);
  error = host.make_error(host.context, MESHRUN_INTERNAL, nullptr);
  REQUIRE(error != nullptr);
  CHECK(std::string(error->message).empty());
  meshrun_error_release(error);

  for (const size_t alignment : {size_t{1}, size_t{8}, size_t{64}, size_t{4096}}) {
    void* memory = host.allocate(host.context, 100, alignment);
    REQUIRE(memory != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(memory) % alignment == 0);
    std::memset(memory, 0xab, 100);
    host.deallocate(host.context, memory);
  }
  CHECK(host.allocate(host.context, 16, 3) == nullptr);
  CHECK(host.allocate(host.context, SIZE_MAX, 64) == nullptr);
  host.deallocate(host.context, nullptr);
}
