/*
 * meshrun/sidecar.h — the model sidecar ABI (plugin kind "sidecar", AutoModel's
 * "ModelParallelizer").
 *
 * A sidecar turns a model description and the mesh into the plan as data:
 * sharding units, the tensor-parallel placement of every parameter, the
 * pipeline stage of every module, the activation-checkpoint set. Data, not
 * callbacks, so the host can print, check and simulate it before running.
 * Request and plan are JSON objects (docs/plan.md gives their fields), which
 * keeps the table small while the plan grows.
 *
 * Fields after `extensions` of meshrun_sidecar_api arrived in ABI 1.2; test
 * them with MESHRUN_HAS_FIELD.
 */
#ifndef MESHRUN_SIDECAR_H_
#define MESHRUN_SIDECAR_H_

#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

struct meshrun_sidecar_api {
  size_t struct_size;
  const char* model_type; /* the Hugging Face model_type it plans, e.g. "llama" */
  const meshrun_extension* extensions;

  /* ---- ABI 1.2 ---- */

  /* Plans the model of `request_json` (borrowed for the call) on its mesh.
   * On success *out_plan_json is a NUL-terminated JSON object allocated
   * with the `allocate` of the host services given to `create`; the caller
   * frees it with their `deallocate`. Errors: INVALID_ARGUMENT when the
   * model does not fit the mesh; the message begins with the dotted config
   * key it concerns and ": " (e.g. "model.num_attention_heads: ..."), so the
   * host can point at the key's place in the config file. */
  meshrun_error* (*plan)(meshrun_plugin_instance* instance, const char* request_json,
                         char** out_plan_json);
};

/* The size of the ABI 1.0 and 1.2 sidecar tables. */
#define MESHRUN_SIDECAR_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_sidecar_api, extensions)
#define MESHRUN_SIDECAR_API_SIZE_1_2 MESHRUN_STRUCT_SIZE(meshrun_sidecar_api, plan)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_SIDECAR_H_ */
