/*
 * meshrun/strategy.h — the strategy ABI (plugin kind "strategy").
 *
 * A strategy decides how parameters, gradients and optimizer state are
 * replicated or sharded, and when they are communicated. The host owns the
 * model's compute and its buffers; it hands the strategy flat views of them
 * and calls it at module boundaries (DESIGN.md "Hooks"):
 *
 *   setup(...)                       once, after the mesh and communicators
 *   broadcast_parameters()           once, so every replica starts equal
 *   per optimizer step:
 *     per micro-batch:
 *       begin_micro_batch(sync)      sync = 1 on the step's last micro-batch
 *       gradients_ready(begin, end)  as backward finishes each module
 *     finish_gradients()             gradients now hold the step's average
 *
 * Fields after `extensions` of meshrun_strategy_api arrived in ABI 1.2; test
 * them with MESHRUN_HAS_FIELD.
 */
#ifndef MESHRUN_STRATEGY_H_
#define MESHRUN_STRATEGY_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#include "meshrun/comm.h"
#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Declared again (C11 allows it) for when comm.h is still being read. */
typedef struct meshrun_communicator meshrun_communicator;

/* What a strategy works on. The struct is borrowed for the `setup` call;
 * everything it points to (communicator, buffers, arrays, strings) stays
 * valid and owned by the host until the strategy instance is destroyed. */
typedef struct meshrun_strategy_setup {
  size_t struct_size;
  const meshrun_comm_api* comm;        /* the comm backend's table */
  meshrun_communicator* data_parallel; /* the data-parallel communicator */
  DLTensor parameters;                 /* every parameter, one flat float32 buffer */
  DLTensor gradients;                  /* their gradients, the same layout */
  int64_t num_parameters;              /* parameter tensors in the buffers */
  /* num_parameters + 1 element offsets: tensor i is [offsets[i], offsets[i+1]). */
  const int64_t* parameter_offsets;
  const char* const* parameter_names; /* num_parameters Hugging Face names */
  /* The [distributed] config as one JSON object (AutoModel's key names). */
  const char* options_json;
  const meshrun_extension* extensions;
} meshrun_strategy_setup;

/* Bytes a strategy holds for one rank, for the run's memory accounting. */
typedef struct meshrun_strategy_memory {
  size_t struct_size;
  int64_t buffers; /* communication buffers and gathered parameters */
} meshrun_strategy_memory;

struct meshrun_strategy_api {
  size_t struct_size;
  int32_t mesh_family; /* MESHRUN_MESH_FAMILY_* */
  const meshrun_extension* extensions;

  /* ---- ABI 1.2 ---- */

  /* Prepares the strategy (buckets, shards) over `setup`. Once per instance.
   * Errors: INVALID_ARGUMENT (bad setup, an option the strategy rejects,
   * naming the key), FAILED_PRECONDITION (called twice). */
  meshrun_error* (*setup)(meshrun_plugin_instance* instance, const meshrun_strategy_setup* setup);
  /* Makes every rank's parameters equal to data-parallel rank 0's; returns
   * when done. Collective over the data-parallel communicator. */
  meshrun_error* (*broadcast_parameters)(meshrun_plugin_instance* instance);
  /* Starts a micro-batch. `sync` = 1 on the micro-batch that ends an
   * optimizer step (gradients are reduced during its backward), 0 on the
   * others (gradients only accumulate locally: deferred sync). */
  meshrun_error* (*begin_micro_batch)(meshrun_plugin_instance* instance, int32_t sync);
  /* The gradients in element range [begin, end) of the buffer are final for
   * this backward; a strategy may start reducing them. Ranges are whole
   * parameters; every parameter is reported once per backward. */
  meshrun_error* (*gradients_ready)(meshrun_plugin_instance* instance, int64_t begin, int64_t end);
  /* After the step's last backward: returns when the gradient buffer holds
   * the average over the data-parallel ranks of every rank's accumulated
   * gradients. Collective over the data-parallel communicator. */
  meshrun_error* (*finish_gradients)(meshrun_plugin_instance* instance);
  /* Writes the bytes this strategy holds into *out (out->struct_size set by
   * the caller). */
  meshrun_error* (*memory)(meshrun_plugin_instance* instance, meshrun_strategy_memory* out);
};

/* The size of the ABI 1.0 and 1.2 strategy tables. */
#define MESHRUN_STRATEGY_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, extensions)
#define MESHRUN_STRATEGY_API_SIZE_1_2 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, memory)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_STRATEGY_H_ */
