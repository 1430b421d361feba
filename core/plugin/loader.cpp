// The plugin loader: the search path, dlopen, and the checks a host makes
// before it trusts a plugin's table (docs/design.md, ABI rules 2-4). Every failure
// is a meshrun::Error whose message starts with "plugin FILE: ".
#include "plugin/loader.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
#include <utility>

#include "errors.hpp"
#include "plugin/call_scope.hpp"
#include "support/suggest.hpp"

namespace meshrun {
namespace fs = std::filesystem;

namespace {

constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL;

constexpr std::string_view kFilePrefix = "meshrun_";
constexpr std::string_view kFileSuffix = ".so";

constexpr std::array<std::pair<PluginKind, std::string_view>, 5> kKinds = {{
    {PluginKind::strategy, "strategy"},
    {PluginKind::schedule, "schedule"},
    {PluginKind::sidecar, "sidecar"},
    {PluginKind::comm, "comm"},
    {PluginKind::model, "model"},
}};

bool valid_plugin_name(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string plugin_file_name(PluginKind kind, std::string_view name) {
  return std::string(kFilePrefix) + std::string(plugin_kind_name(kind)) + "_" + std::string(name) +
         std::string(kFileSuffix);
}

// What a file name meshrun_<kind>_<name>.so spells. Kinds contain no '_', so
// the first '_' after the prefix ends the kind. The kind is as spelled: it may
// not be a known kind, and the name may be empty.
struct FileNameParts {
  std::string kind;
  std::string name;
};

std::optional<FileNameParts> split_file_name(std::string_view file) {
  if (!file.starts_with(kFilePrefix) || !file.ends_with(kFileSuffix)) return std::nullopt;
  const std::string_view stem =
      file.substr(kFilePrefix.size(), file.size() - kFilePrefix.size() - kFileSuffix.size());
  const size_t underscore = stem.find('_');
  if (underscore == std::string_view::npos) return std::nullopt;
  return FileNameParts{std::string(stem.substr(0, underscore)),
                       std::string(stem.substr(underscore + 1))};
}

struct PluginFile {
  std::string path;
  FileNameParts parts;
};

// The plugin files of one directory, sorted by file name. A directory that
// does not exist or cannot be read holds none: search paths routinely name
// directories that only some installations have.
std::vector<PluginFile> plugin_files(const std::string& dir) {
  std::vector<PluginFile> files;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    auto parts = split_file_name(file);
    std::error_code type_ec;
    if (parts && fs::is_regular_file(it->path(), type_ec)) {
      files.push_back({(fs::path(dir) / file).string(), std::move(*parts)});
    }
  }
  std::sort(files.begin(), files.end(),
            [](const PluginFile& a, const PluginFile& b) { return a.path < b.path; });
  return files;
}

std::string version_text(int32_t major, int32_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

std::string supported_range(const VersionPolicy& policy) {
  return version_text(policy.major, policy.oldest_minor) + " .. " + std::to_string(policy.major) +
         ".x";
}

[[noreturn]] void fail(int32_t code, const std::string& path, const std::string& reason) {
  throw Error(code, "plugin " + path + ": " + reason);
}

// The kind-specific table a plugin of `kind` must carry, as the loader sees
// any of them: where it is, the size it declares, and the size of the
// kind's first ABI version (1.0; 1.5 for models) with the version's name.
struct KindTable {
  PluginKind kind;
  const void* table;
  size_t struct_size;
  size_t first_size;
  const char* first_version;
};

template <class Table>
KindTable kind_table(PluginKind kind, const Table* table, size_t first_size,
                     const char* first_version = "1.0") {
  return {kind, table, table != nullptr ? table->struct_size : 0, first_size, first_version};
}

// A table older than ABI 1.5 ends before `model`: it carries no model table.
const meshrun_model_api* model_table(const meshrun_plugin_api& api) {
  return MESHRUN_HAS_FIELD(meshrun_plugin_api, &api, model) ? api.model : nullptr;
}

std::array<KindTable, 5> kind_tables(const meshrun_plugin_api& api) {
  return {{
      kind_table(PluginKind::strategy, api.strategy,
                 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, extensions)),
      kind_table(PluginKind::schedule, api.schedule,
                 MESHRUN_STRUCT_SIZE(meshrun_schedule_api, extensions)),
      kind_table(PluginKind::sidecar, api.sidecar,
                 MESHRUN_STRUCT_SIZE(meshrun_sidecar_api, extensions)),
      kind_table(PluginKind::comm, api.comm, MESHRUN_STRUCT_SIZE(meshrun_comm_api, extensions)),
      kind_table(PluginKind::model, model_table(api), MESHRUN_MODEL_API_SIZE_1_5, "1.5"),
  }};
}

// Checks a table the plugin returned, in the order that keeps every read in
// bounds: the version fields first (they sit at the same place in every
// major, so another major is named as such), then the 1.0 size, then the
// fields.
void check_api(const meshrun_plugin_api& api, const std::string& path, const FileNameParts& file,
               const VersionPolicy& policy) {
  constexpr size_t version_size = MESHRUN_STRUCT_SIZE(meshrun_plugin_api, abi_minor);
  if (api.struct_size < version_size) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "plugin table too small to hold its ABI version: struct_size " +
             std::to_string(api.struct_size) + " < " + std::to_string(version_size));
  }
  const std::string version = version_text(api.abi_major, api.abi_minor);
  if (api.abi_major != policy.major) {
    fail(MESHRUN_VERSION_MISMATCH, path,
         "ABI version " + version +
             " is another major version (supported: " + supported_range(policy) + ")");
  }
  if (api.abi_minor < policy.oldest_minor) {
    fail(MESHRUN_VERSION_MISMATCH, path,
         "ABI version " + version +
             " is older than the oldest supported (supported: " + supported_range(policy) + ")");
  }
  if (api.struct_size < MESHRUN_PLUGIN_API_SIZE_1_0) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "plugin table too small: struct_size " + std::to_string(api.struct_size) + " < " +
             std::to_string(MESHRUN_PLUGIN_API_SIZE_1_0) + " (ABI 1.0)");
  }
  const auto kind = plugin_kind_from_name(file.kind);
  const bool known_kind = std::any_of(kKinds.begin(), kKinds.end(), [&](const auto& entry) {
    return static_cast<int32_t>(entry.first) == api.kind;
  });
  if (!known_kind) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "declares unknown plugin kind " + std::to_string(api.kind) +
             " (known: 1 strategy, 2 schedule, 3 sidecar, 4 comm, 5 model)");
  }
  const auto declared_kind = static_cast<PluginKind>(api.kind);
  if (declared_kind != kind) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "declares kind '" + std::string(plugin_kind_name(declared_kind)) +
             "' but its file name says '" + file.kind + "'");
  }
  if (api.name == nullptr) fail(MESHRUN_INVALID_ARGUMENT, path, "declares no name (name is NULL)");
  if (api.name != file.name) {
    fail(
        MESHRUN_INVALID_ARGUMENT, path,
        "declares name '" + std::string(api.name) + "' but its file name says '" + file.name + "'");
  }
  if (api.create == nullptr || api.destroy == nullptr) {
    fail(MESHRUN_INVALID_ARGUMENT, path, "create or destroy is NULL");
  }
  for (const KindTable& table : kind_tables(api)) {
    const std::string table_kind(plugin_kind_name(table.kind));
    if (table.kind != declared_kind) {
      if (table.table != nullptr) {
        fail(MESHRUN_INVALID_ARGUMENT, path,
             "is a " + file.kind + " plugin but also carries a " + table_kind + " table");
      }
    } else if (table.table == nullptr) {
      fail(MESHRUN_INVALID_ARGUMENT, path,
           "is a " + table_kind + " plugin but its " + table_kind + " table is NULL");
    } else if (table.struct_size < table.first_size) {
      fail(MESHRUN_INVALID_ARGUMENT, path,
           table_kind + " table too small: struct_size " + std::to_string(table.struct_size) +
               " < " + std::to_string(table.first_size) + " (ABI " + table.first_version + ")");
    }
  }
}

struct DlClose {
  void operator()(void* handle) const { dlclose(handle); }
};

}  // namespace

// The build tree mirrors the install tree, so the same rule finds build/lib
// and <prefix>/lib.
std::optional<std::string> library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&library_dir), &info) == 0 || info.dli_fname == nullptr) {
    return std::nullopt;
  }
  const fs::path module_path(info.dli_fname);
  const std::string module_file = module_path.filename().string();
  const bool shared_library =
      module_file.ends_with(".so") || module_file.find(".so.") != std::string::npos;
  std::error_code ec;
  if (shared_library) {
    const fs::path lib = fs::weakly_canonical(module_path, ec);
    return (ec ? module_path : lib).parent_path().lexically_normal().string();
  }
  // dli_fname of the main program is argv[0] as typed (relative, or found on
  // PATH); /proc/self/exe is the file actually running.
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return std::nullopt;
  return (exe.parent_path() / MESHRUN_LIB_DIR_FROM_BIN).lexically_normal().string();
}

std::string library_folder_file(const std::string& file) {
  return (fs::path(library_dir().value_or(".")) / file).string();
}

void* load_library_symbol(const std::string& path, const char* symbol, const std::string& context,
                          int32_t load_failure) {
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    throw Error(load_failure, context + ": " + path + " cannot be loaded: " + dlerror());
  }
  void* found = dlsym(library, symbol);
  if (found == nullptr) {
    throw Error(MESHRUN_INTERNAL, context + ": " + path + " has no " + symbol);
  }
  return found;
}

namespace {

// The plugin folder of this build or installation: <libdir>/meshrun/plugins.
std::optional<std::string> default_plugin_dir() {
  const auto lib = library_dir();
  if (!lib) return std::nullopt;
  return (fs::path(*lib) / "meshrun" / "plugins").string();
}

bool same_directory(const std::string& a, const std::string& b) {
  std::error_code ec_a;
  std::error_code ec_b;
  const fs::path canonical_a = fs::weakly_canonical(a, ec_a);
  const fs::path canonical_b = fs::weakly_canonical(b, ec_b);
  if (ec_a || ec_b) return fs::path(a).lexically_normal() == fs::path(b).lexically_normal();
  return canonical_a == canonical_b;
}

// MESHRUN_PLUGIN_PATH's folders, in order. A relative folder would load code
// from whatever directory meshrun is started in, so it is refused; empty
// elements (a stray ':') name no folder and are skipped.
std::vector<std::string> plugin_path_from_environment() {
  std::vector<std::string> dirs;
  const char* env = std::getenv("MESHRUN_PLUGIN_PATH");
  if (env == nullptr) return dirs;
  const std::string_view path = env;
  for (size_t start = 0; start <= path.size();) {
    const size_t colon = std::min(path.find(':', start), path.size());
    const std::string dir(path.substr(start, colon - start));
    start = colon + 1;
    if (dir.empty()) continue;
    if (dir.front() != '/') {
      throw Error(MESHRUN_INVALID_ARGUMENT,
                  "MESHRUN_PLUGIN_PATH: element '" + dir +
                      "' is a relative path, which would load plugins from whatever directory "
                      "meshrun is started in; use absolute paths (here: '" +
                      fs::absolute(dir).lexically_normal().string() + "')");
    }
    dirs.push_back(dir);
  }
  return dirs;
}

// A plugin file, or the folder it is found in, that every user may write:
// anyone on the machine can put their code into this process (in a folder,
// even one with the sticky bit, by adding a plugin that is not there yet).
// Warned about once per path rather than refused, since a machine may share
// a folder on purpose (docs/decisions.md).
void warn_if_writable_by_others(const fs::path& path, std::string_view what) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 || (info.st_mode & S_IWOTH) == 0) return;
  static std::mutex mutex;
  static std::set<std::string> warned;
  const std::lock_guard lock(mutex);
  if (!warned.insert(path.string()).second) return;
  std::fprintf(stderr,
               "meshrun: warning: plugin %s %s is writable by every user (mode %04o), who can "
               "make meshrun run their code; remove that permission (chmod o-w)\n",
               std::string(what).c_str(), path.c_str(), unsigned(info.st_mode & 07777));
}

const char* log_level_name(int32_t level) {
  switch (level) {
    case MESHRUN_LOG_DEBUG:
      return "DEBUG";
    case MESHRUN_LOG_INFO:
      return "INFO";
    case MESHRUN_LOG_WARNING:
      return "WARNING";
    case MESHRUN_LOG_ERROR:
      return "ERROR";
    default:
      return "LOG";
  }
}

// MESHRUN_LOG_LEVEL=debug|info|warning|error (default info): plugin lines
// below it are dropped.
int32_t minimum_log_level() {
  static const int32_t minimum = [] {
    const char* setting = std::getenv("MESHRUN_LOG_LEVEL");
    const std::string_view level = setting != nullptr ? setting : "info";
    if (level == "debug") return MESHRUN_LOG_DEBUG;
    if (level == "warning") return MESHRUN_LOG_WARNING;
    if (level == "error") return MESHRUN_LOG_ERROR;
    return MESHRUN_LOG_INFO;
  }();
  return minimum;
}

void host_log(void* /*context*/, int32_t level, const char* message) {
  if (level < minimum_log_level()) return;
  std::fprintf(stderr, "meshrun [plugin] %s: %s\n", log_level_name(level),
               message != nullptr ? message : "");
}

void host_free_error(meshrun_error* error) { std::free(error); }
void host_keep_error(meshrun_error* /*error*/) {}

// Handed out when even a small allocation fails, so that make_error keeps its
// promise never to return NULL (which would read as success).
meshrun_error host_out_of_memory = {sizeof(meshrun_error), MESHRUN_INTERNAL,
                                    "out of memory while reporting an error", &host_keep_error};

// One block: the error header, then its message.
meshrun_error* host_make_error(void* /*context*/, int32_t code, const char* message) {
  const std::string_view text = message != nullptr ? message : "";
  void* block = std::malloc(sizeof(meshrun_error) + text.size() + 1);
  if (block == nullptr) return &host_out_of_memory;
  char* copy = static_cast<char*>(block) + sizeof(meshrun_error);
  std::copy(text.begin(), text.end(), copy);
  copy[text.size()] = '\0';
  return new (block) meshrun_error{sizeof(meshrun_error), code, copy, &host_free_error};
}

void* host_allocate(void* /*context*/, size_t bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) return nullptr;
  // aligned_alloc wants a size that is a multiple of the alignment.
  const size_t rounded = bytes == 0 ? alignment : (bytes + alignment - 1) & ~(alignment - 1);
  if (rounded < bytes) return nullptr;
  return std::aligned_alloc(alignment, rounded);
}

void host_deallocate(void* /*context*/, void* pointer) { std::free(pointer); }

}  // namespace

std::string_view plugin_kind_name(PluginKind kind) {
  for (const auto& [entry_kind, name] : kKinds) {
    if (entry_kind == kind) return name;
  }
  return "unknown";
}

std::optional<PluginKind> plugin_kind_from_name(std::string_view name) {
  for (const auto& [kind, entry_name] : kKinds) {
    if (entry_name == name) return kind;
  }
  return std::nullopt;
}

std::vector<std::string> plugin_kind_names() {
  std::vector<std::string> names;
  for (const auto& entry : kKinds) names.emplace_back(entry.second);
  return names;
}

PluginLibrary::PluginLibrary(void* handle, const meshrun_plugin_api* api, std::string path)
    : handle_(handle), api_(api), path_(std::move(path)) {}

PluginLibrary::~PluginLibrary() {
  if (handle_ == nullptr) return;
  // dlclose runs the plugin's static destructors.
  const PluginCallScope scope(*this, "unload (dlclose)");
  dlclose(handle_);
}

PluginLoader::PluginLoader(std::vector<std::string> search_path, VersionPolicy policy)
    : search_path_(std::move(search_path)), policy_(policy) {}

PluginLoader PluginLoader::from_environment() {
  std::vector<std::string> dirs;
  const auto add = [&](const std::string& dir) {
    if (dir.empty()) return;
    const bool known = std::any_of(dirs.begin(), dirs.end(), [&](const std::string& seen) {
      return same_directory(seen, dir);
    });
    if (!known) dirs.push_back(dir);
  };
  if (const auto dir = default_plugin_dir()) add(*dir);
  for (const std::string& dir : plugin_path_from_environment()) add(dir);
  return PluginLoader(std::move(dirs));
}

std::optional<std::string> PluginLoader::find(PluginKind kind, std::string_view name) const {
  if (!valid_plugin_name(name)) return std::nullopt;
  const std::string file = plugin_file_name(kind, name);
  for (const auto& dir : search_path_) {
    const fs::path candidate = fs::path(dir) / file;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec)) return candidate.string();
  }
  return std::nullopt;
}

std::vector<std::string> PluginLoader::available(PluginKind kind) const {
  std::set<std::string> names;
  for (const auto& dir : search_path_) {
    for (auto& file : plugin_files(dir)) {
      if (file.parts.kind == plugin_kind_name(kind) && valid_plugin_name(file.parts.name)) {
        names.insert(std::move(file.parts.name));
      }
    }
  }
  return {names.begin(), names.end()};
}

std::shared_ptr<PluginLibrary> PluginLoader::load(PluginKind kind, std::string_view name) const {
  if (auto path = find(kind, name)) return load_file(*path, kind, name);
  const std::string kind_name(plugin_kind_name(kind));
  const std::vector<std::string> names = available(kind);
  throw Error(MESHRUN_NOT_FOUND,
              "no " + kind_name + " plugin named '" + std::string(name) + "'" +
                  did_you_mean(name, names) +
                  "; available: " + (names.empty() ? "none" : join_names(names)) +
                  "; searched for " + plugin_file_name(kind, valid_plugin_name(name) ? name : "*") +
                  " in: " + (search_path_.empty() ? "no directories" : join_names(search_path_)) +
                  " (add directories with MESHRUN_PLUGIN_PATH)");
}

std::shared_ptr<PluginLibrary> PluginLoader::load_file(const std::string& path,
                                                       std::optional<PluginKind> expect_kind,
                                                       std::string_view expect_name) const {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(MESHRUN_NOT_FOUND, path, "file does not exist");
  const std::string file = fs::path(path).filename().string();
  const auto parts = split_file_name(file);
  if (!parts || !valid_plugin_name(parts->name)) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "file name '" + file + "' does not follow meshrun_<kind>_<name>.so (name: [a-z0-9_]+)");
  }
  const auto file_kind = plugin_kind_from_name(parts->kind);
  if (!file_kind) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "file name names unknown plugin kind '" + parts->kind + "'" +
             did_you_mean(parts->kind, plugin_kind_names()) +
             " (valid: " + join_names(plugin_kind_names()) + ")");
  }

  // A path without '/' would make dlopen search the library path instead.
  const std::string open_path = path.find('/') == std::string::npos ? "./" + path : path;
  warn_if_writable_by_others(fs::path(open_path).parent_path(), "folder");
  warn_if_writable_by_others(open_path, "file");
  dlerror();
  // dlopen runs the plugin's static initializers.
  std::unique_ptr<void, DlClose> handle([&] {
    const PluginCallScope scope(path, *file_kind, "load (dlopen)");
    return dlopen(open_path.c_str(), kDlopenFlags);
  }());
  if (!handle) {
    const char* reason = dlerror();
    fail(MESHRUN_INVALID_ARGUMENT, path,
         std::string("cannot be loaded: ") + (reason != nullptr ? reason : "dlopen failed"));
  }
  dlerror();
  void* entry = dlsym(handle.get(), MESHRUN_PLUGIN_ENTRY_SYMBOL);
  if (entry == nullptr) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "no " MESHRUN_PLUGIN_ENTRY_SYMBOL
         " symbol: not a meshrun plugin, or built without "
         "exporting its entry point");
  }
  const meshrun_plugin_api* api = [&] {
    const PluginCallScope scope(path, *file_kind, MESHRUN_PLUGIN_ENTRY_SYMBOL);
    return reinterpret_cast<meshrun_plugin_get_api_fn>(entry)();
  }();
  if (api == nullptr)
    fail(MESHRUN_INVALID_ARGUMENT, path, MESHRUN_PLUGIN_ENTRY_SYMBOL "() returned NULL");
  check_api(*api, path, *parts, policy_);

  const auto kind = static_cast<PluginKind>(api->kind);
  if (expect_kind && *expect_kind != kind) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "is a " + std::string(plugin_kind_name(kind)) + " plugin, not a " +
             std::string(plugin_kind_name(*expect_kind)) + " plugin");
  }
  if (!expect_name.empty() && expect_name != api->name) {
    fail(MESHRUN_INVALID_ARGUMENT, path,
         "is named '" + std::string(api->name) + "', not '" + std::string(expect_name) + "'");
  }
  auto library = std::make_shared<PluginLibrary>(handle.get(), api, path);
  handle.release();
  return library;
}

std::vector<PluginInfo> PluginLoader::list(std::optional<PluginKind> kind) const {
  std::vector<PluginInfo> rows;
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& dir : search_path_) {
    for (auto& file : plugin_files(dir)) {
      if (kind && file.parts.kind != plugin_kind_name(*kind)) continue;
      PluginInfo info;
      info.path = file.path;
      info.kind = file.parts.kind;
      info.name = file.parts.name;
      info.shadowed = !seen.insert({info.kind, info.name}).second;
      try {
        const auto library = load_file(info.path);
        const meshrun_plugin_api& api = library->api();
        info.abi_major = api.abi_major;
        info.abi_minor = api.abi_minor;
        info.version = api.version != nullptr ? api.version : "";
        info.description = api.description != nullptr ? api.description : "";
      } catch (const Error& e) {
        info.error = e.what();
      }
      rows.push_back(std::move(info));
    }
  }
  return rows;
}

const meshrun_host_services& host_services() {
  static const meshrun_host_services services = {
      sizeof(meshrun_host_services),
      MESHRUN_ABI_VERSION_MAJOR,
      MESHRUN_ABI_VERSION_MINOR,
      nullptr,
      &host_log,
      &host_make_error,
      &host_allocate,
      &host_deallocate,
      nullptr,
  };
  return services;
}

const meshrun_extension& require_extension(const PluginLibrary& library,
                                           const meshrun_extension* list, int32_t type,
                                           std::string_view feature) {
  if (const meshrun_extension* extension = meshrun_extension_find(list, type)) return *extension;
  fail(MESHRUN_UNIMPLEMENTED, library.path(),
       "does not implement " + std::string(feature) + " (extension type " + std::to_string(type) +
           ")");
}

Error take_plugin_error(const PluginLibrary& library, const std::string& what,
                        meshrun_error* error) {
  const std::string prefix = "plugin " + library.path() + ": " + what + ": ";
  if (error->struct_size < MESHRUN_STRUCT_SIZE(meshrun_error, destroy)) {
    // Too small to hold a destroy function: it cannot be released safely.
    return Error(MESHRUN_INTERNAL, prefix + "returned a malformed error (struct_size " +
                                       std::to_string(error->struct_size) + ")");
  }
  const int32_t code = error->code != MESHRUN_OK ? error->code : MESHRUN_INTERNAL;
  const std::string message = error->message != nullptr ? error->message : "(no message)";
  meshrun_error_release(error);
  return Error(code, prefix + message);
}

PluginInstance::PluginInstance(std::shared_ptr<PluginLibrary> library,
                               const meshrun_host_services& host)
    : library_(std::move(library)) {
  if (!library_) throw invalid_argument("PluginInstance: no plugin library");
  meshrun_plugin_instance* instance = nullptr;
  if (meshrun_error* error = call_plugin(
          *library_, "create", [&] { return library_->api().create(&host, &instance); })) {
    throw take_plugin_error(*library_, "create failed", error);
  }
  // Every entry point takes the instance and refuses NULL, so the plugin
  // would fail later, far from its cause.
  if (instance == nullptr) {
    fail(MESHRUN_INVALID_ARGUMENT, library_->path(), "create succeeded but returned no instance");
  }
  instance_ = instance;
}

PluginInstance::~PluginInstance() {
  call_plugin(*library_, "destroy", [&] { library_->api().destroy(instance_); });
}

}  // namespace meshrun
