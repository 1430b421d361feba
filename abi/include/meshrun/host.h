/*
 * meshrun/host.h — the host API of libmeshrun, for programs that drive the
 * runtime: the CLI, C/C++ hosts, and other languages through FFI (Python
 * ctypes first; see examples/python/meshrun.py).
 *
 * Lifecycle of a runtime: created (config parsed and validated) -> mesh built
 * -> ... -> destroyed. A call made in the wrong state returns a
 * FAILED_PRECONDITION error; nothing is undefined behaviour.
 *
 * Ownership: every `meshrun_error*` returned is owned by the caller (release
 * with meshrun_error_release). Out-parameters are written only on success.
 * Strings the API returns are owned as each function states.
 *
 * Axis names accepted by the mesh queries: "pp", "dp_replicate", "dp_shard",
 * "cp", "tp" (the mesh, outermost first, tp fastest-varying), the flattened
 * "dp", "dp_shard_cp", "dp_cp", and, when distributed.ep_size > 1, the MoE
 * mesh "ep_shard", "ep" (per pipeline stage).
 */
#ifndef MESHRUN_HOST_H_
#define MESHRUN_HOST_H_

#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MESHRUN_HOST_API __attribute__((visibility("default")))
#else
#define MESHRUN_HOST_API
#endif

/* ABI version of this library (MESHRUN_ABI_VERSION_* it was built with). */
MESHRUN_HOST_API int32_t meshrun_abi_version_major(void);
MESHRUN_HOST_API int32_t meshrun_abi_version_minor(void);

/* The library's release version, e.g. "0.1.0"; static storage. */
MESHRUN_HOST_API const char* meshrun_library_version(void);

/* A runtime: one run's configuration, mesh and plugins. Opaque. */
typedef struct meshrun_runtime meshrun_runtime;

/* Parses and validates TOML config text. `source_name` names the text in
 * error messages ("<string>" when NULL). On success *out owns a new runtime
 * (destroy with meshrun_runtime_destroy). Errors: INVALID_ARGUMENT for NULL
 * arguments or bad config (message "source:line:col: key: reason"). */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_create_from_text(const char* toml_text,
                                                                 const char* source_name,
                                                                 meshrun_runtime** out);

/* As meshrun_runtime_create_from_text, reading the file at `path`. Errors:
 * NOT_FOUND when the file cannot be read; INVALID_ARGUMENT as above. */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_create_from_file(const char* path,
                                                                 meshrun_runtime** out);

/* Destroys a runtime and everything it owns; NULL is accepted. */
MESHRUN_HOST_API void meshrun_runtime_destroy(meshrun_runtime* runtime);

/* Applies one "key.path=value" override, validated like the file (the value
 * is read as TOML, else as a string). Only before the mesh is built. Errors:
 * INVALID_ARGUMENT (unknown key, wrong type or value), FAILED_PRECONDITION. */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_override(meshrun_runtime* runtime,
                                                         const char* assignment);

/* Resolves the device mesh for `world_size` ranks and records `rank` as this
 * process's rank. Loads the configured strategy plugin to learn its mesh
 * family. Errors: INVALID_ARGUMENT (sizes that do not fit the world, a rank
 * outside [0, world_size)), NOT_FOUND (unknown strategy), FAILED_PRECONDITION
 * (mesh already built). */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_build_mesh(meshrun_runtime* runtime,
                                                           int64_t world_size, int64_t rank);

/* Size of `axis`. Errors: FAILED_PRECONDITION before the mesh is built;
 * NOT_FOUND for an unknown axis (or an MoE axis without an MoE mesh). */
MESHRUN_HOST_API meshrun_error* meshrun_mesh_axis_size(const meshrun_runtime* runtime,
                                                       const char* axis, int64_t* out_size);

/* Index of `rank` along `axis`, in [0, size). Errors as axis_size, plus
 * OUT_OF_RANGE for a rank outside the world. */
MESHRUN_HOST_API meshrun_error* meshrun_mesh_coordinate(const meshrun_runtime* runtime,
                                                        int64_t rank, const char* axis,
                                                        int64_t* out_index);

/* Number of groups of `axis`: world_size / size(axis). Errors as axis_size. */
MESHRUN_HOST_API meshrun_error* meshrun_mesh_group_count(const meshrun_runtime* runtime,
                                                         const char* axis, int64_t* out_count);

/* Ranks of the `axis` group containing `rank`, ordered by their index along
 * the axis, written to out_ranks[0 .. size-1]. `capacity` is the length of
 * out_ranks; *out_count receives size(axis). Errors as coordinate, plus
 * OUT_OF_RANGE when capacity < size(axis) (then *out_count is still set). */
MESHRUN_HOST_API meshrun_error* meshrun_mesh_group_ranks(const meshrun_runtime* runtime,
                                                         const char* axis, int64_t rank,
                                                         int64_t* out_ranks, int64_t capacity,
                                                         int64_t* out_count);

/* Ranks of group number `group` of `axis` (groups numbered by their lowest
 * rank, from 0 to group_count-1); otherwise as meshrun_mesh_group_ranks. */
MESHRUN_HOST_API meshrun_error* meshrun_mesh_group_ranks_by_index(const meshrun_runtime* runtime,
                                                                  const char* axis, int64_t group,
                                                                  int64_t* out_ranks,
                                                                  int64_t capacity,
                                                                  int64_t* out_count);

/* The plan as one JSON object, the same as `meshrun plan --json`. On success
 * *out_json owns a NUL-terminated string; free it with meshrun_string_destroy.
 * Errors: FAILED_PRECONDITION before the mesh is built. */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_plan_json(const meshrun_runtime* runtime,
                                                          char** out_json);

/* Frees a string returned by this API; NULL is accepted. */
MESHRUN_HOST_API void meshrun_string_destroy(char* string);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_HOST_H_ */
