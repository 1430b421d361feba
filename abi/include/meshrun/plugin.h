/*
 * meshrun/plugin.h — the plugin ABI.
 *
 * A plugin is a shared library named `meshrun_<kind>_<name>.so` that exports
 * exactly one symbol, `meshrun_plugin_get_api`, returning a static, immutable
 * `meshrun_plugin_api` table. The plugin reaches the runtime only through the
 * `meshrun_host_services` table handed to `create`; it never links libmeshrun.
 *
 * Rules (see docs/abi.md): every table and struct that crosses the boundary
 * begins with `size_t struct_size`; fields are only ever added at the end, and
 * a reader accepts any struct_size >= the size it needs, feature-testing newer
 * fields with MESHRUN_HAS_FIELD. Enums are stored as int32_t. Nothing throws
 * across the boundary.
 */
#ifndef MESHRUN_PLUGIN_H_
#define MESHRUN_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Size of `type` up to and including `field`: the struct_size a table of the
 * version that ended with `field` carries. */
#define MESHRUN_STRUCT_SIZE(type, field) (offsetof(type, field) + sizeof(((type*)0)->field))

/* True when the struct at `ptr` (of `type`) is large enough to hold `field`. */
#define MESHRUN_HAS_FIELD(type, ptr, field) ((ptr)->struct_size >= MESHRUN_STRUCT_SIZE(type, field))

#if defined(__GNUC__)
#define MESHRUN_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define MESHRUN_PLUGIN_EXPORT
#endif

/* Plugin kinds (meshrun_plugin_api.kind). The kind is also the middle part of
 * the plugin's file name: meshrun_strategy_ddp.so. */
#define MESHRUN_PLUGIN_KIND_STRATEGY 1 /* ddp, fsdp2, megatron_fsdp, ... */
#define MESHRUN_PLUGIN_KIND_SCHEDULE 2 /* gpipe, 1f1b, interleaved_1f1b, ... */
#define MESHRUN_PLUGIN_KIND_SIDECAR 3  /* model parallelizer: llama, ... */
#define MESHRUN_PLUGIN_KIND_COMM 4     /* mpi, nccl */
#define MESHRUN_PLUGIN_KIND_MODEL 5    /* llama, gpt2, ... (ABI 1.5) */

/* Log levels for meshrun_host_services.log. */
#define MESHRUN_LOG_DEBUG 0
#define MESHRUN_LOG_INFO 1
#define MESHRUN_LOG_WARNING 2
#define MESHRUN_LOG_ERROR 3

/* Services the host offers a plugin. Handed to `create`; borrowed: valid from
 * `create` until the matching `destroy` returns. Every function receives
 * `context` as its first argument. */
typedef struct meshrun_host_services {
  size_t struct_size;
  int32_t abi_major; /* the host's ABI version */
  int32_t abi_minor;
  void* context;
  /* Writes one log line attributed to the plugin; `message` is borrowed. */
  void (*log)(void* context, int32_t level, const char* message);
  /* Makes an error object owned by the caller (release with its destroy).
   * Lets plain-C plugins return errors without writing their own. Never
   * returns NULL. */
  meshrun_error* (*make_error)(void* context, int32_t code, const char* message);
  /* Allocates `bytes` aligned to `alignment` (a power of two); NULL on
   * failure. Free with `deallocate`. */
  void* (*allocate)(void* context, size_t bytes, size_t alignment);
  /* Frees memory from `allocate`; NULL is accepted. */
  void (*deallocate)(void* context, void* pointer);
  const meshrun_extension* extensions;
} meshrun_host_services;

/* The size of the ABI 1.0 host services table: the least a plugin built
 * against 1.0 may require. */
#define MESHRUN_HOST_SERVICES_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_host_services, extensions)

/* Mesh families (meshrun_strategy_api.mesh_family): which device mesh, and
 * which of AutoModel's validation rules, a strategy uses. */
#define MESHRUN_MESH_FAMILY_FSDP2 1         /* (pp, dp_replicate, dp_shard, cp, tp), MoE */
#define MESHRUN_MESH_FAMILY_MEGATRON_FSDP 2 /* (dp, cp, tp); no pp, ep or HSDP */
#define MESHRUN_MESH_FAMILY_DDP 3           /* (dp); no tp, pp, cp or ep */

/* Strategy-specific table: see meshrun/strategy.h. */
typedef struct meshrun_strategy_api meshrun_strategy_api;

/* Schedule table: see meshrun/schedule.h. */
typedef struct meshrun_schedule_api meshrun_schedule_api;

/* Model sidecar ("ModelParallelizer") table: see meshrun/sidecar.h. */
typedef struct meshrun_sidecar_api meshrun_sidecar_api;

/* Communication backend table: see meshrun/comm.h. */
typedef struct meshrun_comm_api meshrun_comm_api;

/* Model (compute) table: see meshrun/model.h. */
typedef struct meshrun_model_api meshrun_model_api;

/* A plugin's live state, defined by the plugin. Opaque to the host. */
typedef struct meshrun_plugin_instance meshrun_plugin_instance;

/* The table `meshrun_plugin_get_api` returns. Static: owned by the plugin,
 * valid while the library is loaded. Exactly one of strategy / schedule /
 * sidecar / comm / model is non-NULL, the one matching `kind` (`model`
 * arrived in ABI 1.5: test it with MESHRUN_HAS_FIELD). */
typedef struct meshrun_plugin_api {
  size_t struct_size;
  int32_t abi_major;       /* MESHRUN_ABI_VERSION_MAJOR the plugin was built with */
  int32_t abi_minor;       /* MESHRUN_ABI_VERSION_MINOR the plugin was built with */
  int32_t kind;            /* MESHRUN_PLUGIN_KIND_* */
  const char* name;        /* [a-z0-9_]+, equal to the <name> in the file name */
  const char* version;     /* the plugin's own version, free-form */
  const char* description; /* one line for `meshrun plugins` */

  /* Creates an instance. `host` is borrowed until `destroy`. Errors:
   * INVALID_ARGUMENT when `host` or `out` is NULL or host->struct_size is
   * smaller than the plugin needs; whatever the plugin's set-up reports.
   * On error *out is left unchanged. */
  meshrun_error* (*create)(const meshrun_host_services* host, meshrun_plugin_instance** out);
  /* Destroys an instance made by `create`; NULL is accepted. */
  void (*destroy)(meshrun_plugin_instance* instance);

  const meshrun_strategy_api* strategy;
  const meshrun_schedule_api* schedule;
  const meshrun_sidecar_api* sidecar;
  const meshrun_comm_api* comm;
  const meshrun_extension* extensions;

  /* ---- ABI 1.5 ---- */
  const meshrun_model_api* model;
} meshrun_plugin_api;

/* The size of the ABI 1.0 plugin table; the loader refuses smaller ones. */
#define MESHRUN_PLUGIN_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_plugin_api, extensions)

/* The one symbol a plugin exports. Returns the plugin's static table; never
 * NULL. Takes no arguments so that any host can read the version first. */
#define MESHRUN_PLUGIN_ENTRY_SYMBOL "meshrun_plugin_get_api"
typedef const meshrun_plugin_api* (*meshrun_plugin_get_api_fn)(void);
MESHRUN_PLUGIN_EXPORT const meshrun_plugin_api* meshrun_plugin_get_api(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* The kind tables that need more than this header; after the plugin table so
 * that any of the headers can be included first. */
#include "meshrun/comm.h"
#include "meshrun/model.h"
#include "meshrun/schedule.h"
#include "meshrun/sidecar.h"
#include "meshrun/strategy.h"

#endif /* MESHRUN_PLUGIN_H_ */
