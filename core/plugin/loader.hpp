// Finding, loading and version-checking plugins.
//
// A plugin of kind K and name N lives in a file meshrun_K_N.so in one of the
// search directories: first the plugin folder of this build or installation
// (<libdir>/meshrun/plugins, found relative to libmeshrun or the meshrun
// executable), then each directory of MESHRUN_PLUGIN_PATH (colon-separated).
// The first match wins; later files of the same kind and name are shadowed.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshrun/plugin.h"

namespace meshrun {

enum class PluginKind : int32_t {
  strategy = MESHRUN_PLUGIN_KIND_STRATEGY,
  schedule = MESHRUN_PLUGIN_KIND_SCHEDULE,
  sidecar = MESHRUN_PLUGIN_KIND_SIDECAR,
  comm = MESHRUN_PLUGIN_KIND_COMM,
  model = MESHRUN_PLUGIN_KIND_MODEL,
};

std::string_view plugin_kind_name(PluginKind kind);
std::optional<PluginKind> plugin_kind_from_name(std::string_view name);
// "strategy, schedule, sidecar, comm, model"
std::vector<std::string> plugin_kind_names();

// The ABI versions a loader accepts: exactly `major`, minor >= `oldest_minor`.
// Newer minors are accepted: tables are size-prefixed and feature-tested.
struct VersionPolicy {
  int32_t major = MESHRUN_ABI_VERSION_MAJOR;
  int32_t oldest_minor = MESHRUN_ABI_VERSION_MINOR_OLDEST;
};

// A loaded plugin library. Keeps the library mapped for its lifetime; the api
// table is valid while it lives.
class PluginLibrary {
 public:
  PluginLibrary(void* handle, const meshrun_plugin_api* api, std::string path);
  ~PluginLibrary();
  PluginLibrary(const PluginLibrary&) = delete;
  PluginLibrary& operator=(const PluginLibrary&) = delete;

  const meshrun_plugin_api& api() const { return *api_; }
  const std::string& path() const { return path_; }
  PluginKind kind() const { return static_cast<PluginKind>(api_->kind); }
  std::string_view name() const { return api_->name; }

 private:
  void* handle_;
  const meshrun_plugin_api* api_;
  std::string path_;
};

// One row of `meshrun plugins`.
struct PluginInfo {
  std::string path;
  std::string kind;  // as named by the file
  std::string name;
  int32_t abi_major = 0;
  int32_t abi_minor = 0;
  std::string version;
  std::string description;
  bool shadowed = false;  // an earlier directory has the same kind and name
  std::string error;      // non-empty when the file could not be loaded
};

class PluginLoader {
 public:
  explicit PluginLoader(std::vector<std::string> search_path, VersionPolicy policy = {});
  // The default search path: this build's/installation's plugin folder, then
  // MESHRUN_PLUGIN_PATH, whose folders must be absolute (a relative one throws
  // INVALID_ARGUMENT naming it).
  static PluginLoader from_environment();

  const std::vector<std::string>& search_path() const { return search_path_; }

  // Path of the file that would be loaded for (kind, name), without loading.
  std::optional<std::string> find(PluginKind kind, std::string_view name) const;
  // Names of the plugins of `kind` found on the search path, sorted, unique.
  std::vector<std::string> available(PluginKind kind) const;

  // Loads (kind, name). Throws meshrun::Error: NOT_FOUND naming the kind, the
  // directories searched and the available names (with a "did you mean");
  // otherwise as load_file.
  std::shared_ptr<PluginLibrary> load(PluginKind kind, std::string_view name) const;

  // Loads one file and checks it. Every error names the file and the reason:
  // cannot be opened (dlerror), no meshrun_plugin_get_api symbol, NULL table,
  // table smaller than ABI 1.0, another major, a minor older than the oldest
  // supported, unknown kind, a kind or name that disagrees with `expect_kind`
  // / `expect_name` or with the file name, a missing kind table. A file or
  // folder every user can write is warned about on stderr, once per path.
  std::shared_ptr<PluginLibrary> load_file(const std::string& path,
                                           std::optional<PluginKind> expect_kind = {},
                                           std::string_view expect_name = {}) const;

  // Every plugin file on the search path (of `kind`, or all), in search order.
  std::vector<PluginInfo> list(std::optional<PluginKind> kind = {}) const;

 private:
  std::vector<std::string> search_path_;
  VersionPolicy policy_;
};

// The library folder of this build or installation (<libdir>, holding
// libmeshrun and meshrun/plugins): found from libmeshrun when the core runs
// inside it, else from the running program (<bindir>/../lib). nullopt when
// neither can be told.
std::optional<std::string> library_dir();

// The path of `file` in the library folder ("." when library_dir cannot be
// told): where the libraries meshrun loads beside libmeshrun are (its GPU
// parts, which it links no CUDA library for).
std::string library_folder_file(const std::string& file);

// Loads the library at `path` (kept loaded for the process) and returns its
// `symbol`. Throws meshrun::Error prefixed with `context`: `load_failure`
// naming the path and dlerror's reason when it cannot be loaded, INTERNAL
// when it has no such symbol.
void* load_library_symbol(const std::string& path, const char* symbol, const std::string& context,
                          int32_t load_failure);

// The host services table the core hands to plugins: logging through the
// core's logger, errors, and aligned allocation. Static; valid forever.
const meshrun_host_services& host_services();

// The extension of `type` in `list` (a table of `library`, or one of its
// kind tables). Throws meshrun::Error UNIMPLEMENTED naming the plugin file and
// `feature` when the plugin does not provide it (docs/design.md, ABI rule 8).
const meshrun_extension& require_extension(const PluginLibrary& library,
                                           const meshrun_extension* list, int32_t type,
                                           std::string_view feature);

class Error;

// Turns an error a plugin returned into a meshrun::Error carrying its code
// and the message prefixed with "plugin <file>: <what>: ", and releases it
// through the plugin's own destroy.
Error take_plugin_error(const PluginLibrary& library, const std::string& what,
                        meshrun_error* error);

// A live plugin instance: create() on construction, destroy() on
// destruction. Throws meshrun::Error carrying the plugin's error (code and
// message, prefixed with the plugin file) when create fails, and
// INVALID_ARGUMENT naming the file when it succeeds without an instance.
class PluginInstance {
 public:
  explicit PluginInstance(std::shared_ptr<PluginLibrary> library,
                          const meshrun_host_services& host = host_services());
  ~PluginInstance();
  PluginInstance(const PluginInstance&) = delete;
  PluginInstance& operator=(const PluginInstance&) = delete;

  const PluginLibrary& library() const { return *library_; }
  meshrun_plugin_instance* handle() const { return instance_; }

 private:
  std::shared_ptr<PluginLibrary> library_;
  meshrun_plugin_instance* instance_ = nullptr;
};

}  // namespace meshrun
