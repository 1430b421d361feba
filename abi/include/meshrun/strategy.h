/*
 * meshrun/strategy.h — the strategy ABI (plugin kind "strategy").
 *
 * A strategy decides how parameters, gradients and optimizer state are
 * replicated or sharded, and when they are communicated. The host owns the
 * model's compute and its buffers; it hands the strategy flat views of them
 * and calls it at module boundaries (docs/design.md, "The runtime"):
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
 *
 * ABI 1.3 adds sharded strategies (fsdp2). A sharded strategy owns the
 * parameters: it keeps only this rank's shard between uses and materializes
 * a unit's full parameters around its forward and backward. The host then
 * calls, per micro-batch, around every unit u (the root encloses the others):
 *
 *   pre_forward(u)   unit_views(u)   [forward of u]    post_forward(u)
 *   pre_backward(u)  unit_views(u)   [backward of u]   post_backward(u)
 *
 * and steps its optimizer on local_shard() after finish_gradients. A table
 * is sharded when it reaches `gather_parameters` and `local_shard` is set;
 * a replicated one (ddp) leaves the 1.3 entries NULL.
 *
 * ABI 1.6 lets a sharded strategy start without the whole model (Megatron-
 * FSDP's init_fsdp_with_meta_device): a table that sets `weights_by_shard`
 * takes a setup whose `initial_weights` is MESHRUN_INITIAL_WEIGHTS_BY_SHARD;
 * no weights cross setup, and the host writes each rank's initial values
 * into local_shard() itself before broadcast_parameters. It also lets a
 * strategy predict a rank's memory before any rank runs (`plan_memory`).
 *
 * ABI 1.13 states how device tensors (a comm backend whose device_type is
 * kDLCUDA) cross between host and strategy, as DLPack's
 * `__dlpack__(stream=...)` does: whoever hands a tensor over makes the
 * receiver's stream wait for its own work on it (an event and
 * cudaStreamWaitEvent), and nobody waits on the host for that.
 *   - host -> strategy: when the host calls setup, broadcast_parameters,
 *     begin_micro_batch, a hook, finish_gradients or gather_parameters, its
 *     work on the buffers the call reads (weights, gradients written into
 *     unit views, the optimizer's update of local_shard) is enqueued on
 *     `compute_stream`, not necessarily done. The strategy orders its own
 *     work on them after that.
 *   - strategy -> host: what a call fills or lends (unit views after
 *     pre_forward and pre_backward, local_shard after setup and
 *     finish_gradients, gather_parameters' `full`) is ready for the work the
 *     host enqueues on `compute_stream` after the call returns.
 *   - memory the host gives back (a unit's views after its post_ hook) is
 *     reused by the strategy only after the compute_stream work enqueued
 *     before that hook.
 * The strategy's collectives run on `comm_stream`, the stream the host set
 * on every communicator of the setup (meshrun_comm_api.set_stream); the
 * strategy enqueues its own kernels there, so that they overlap the host's
 * compute. Host waits on comm requests stay allowed (finish_gradients may
 * wait, so that a lost peer still ends the step within the comm timeout).
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

  /* ---- ABI 1.3: what a sharded strategy needs (test with MESHRUN_HAS_FIELD) ---- */

  /* The ranks a parameter is sharded over (dp_shard_cp) and the ranks that
   * hold equal shards (dp_replicate, size 1 without HSDP). Both are
   * sub-communicators of data_parallel. */
  meshrun_communicator* shard_group;
  meshrun_communicator* replicate_group;
  /* Units (docs/design.md, "The runtime"): the modules whose parameters are gathered
   * together. Units other than `root_unit` are numbered in forward order
   * (the embedding, the layers, the head); the root encloses them and may
   * hold no parameter (its hooks are still called). */
  int32_t num_units;
  int32_t root_unit;
  const int32_t* parameter_units; /* num_parameters entries in [0, num_units) */
  const int64_t* parameter_rows;  /* num_parameters sizes of dim 0 (1 for scalars) */

  /* ---- ABI 1.6 (test with MESHRUN_HAS_FIELD; a smaller setup means RANK_ZERO) ---- */

  /* Where the shards' initial values come from: MESHRUN_INITIAL_WEIGHTS_*. */
  int32_t initial_weights;

  /* ---- ABI 1.13 (test with MESHRUN_HAS_FIELD; a smaller setup means NULL) ---- */

  /* For a device comm backend: the CUDA stream (cudaStream_t) the host
   * computes on, and the one it set on the setup's communicators; NULL is
   * the legacy default stream. The same stream twice is allowed (no
   * overlap). Both ignored by CPU backends. Borrowed: valid until the
   * instance is destroyed. */
  void* compute_stream;
  void* comm_stream;
} meshrun_strategy_setup;

/* `parameters` holds data-parallel rank 0's full weights; setup copies each
 * rank's shard out of them (ABI 1.3's behaviour). */
#define MESHRUN_INITIAL_WEIGHTS_RANK_ZERO 0
/* `parameters.data` and `gradients.data` are NULL (their shapes are still
 * set): the shard starts at zero, and before broadcast_parameters the host
 * fills local_shard()'s parameters, segment by segment, with the same
 * values on every replica. Only to a table with `weights_by_shard` set;
 * others refuse it with INVALID_ARGUMENT. */
#define MESHRUN_INITIAL_WEIGHTS_BY_SHARD 1

/* Bytes a strategy holds for one rank, for the run's memory accounting. */
typedef struct meshrun_strategy_memory {
  size_t struct_size;
  int64_t buffers; /* communication buffers and gathered parameters, now */
  /* ---- ABI 1.3 ---- */
  int64_t buffers_peak;     /* the most `buffers` has been since setup */
  int64_t buffers_reserved; /* `buffers` plus memory kept for reuse (a cache) */
} meshrun_strategy_memory;

/* What a plan knows of a strategy's work before any rank runs (ABI 1.6):
 * the setup's layout, names and units, the sizes of its groups, no buffers
 * or communicators. Borrowed for the call. */
typedef struct meshrun_strategy_plan_input {
  size_t struct_size;
  const char* options_json;           /* as setup's */
  int64_t num_parameters;             /* as setup's */
  const int64_t* parameter_offsets;   /* num_parameters + 1, as setup's */
  const char* const* parameter_names; /* as setup's */
  int32_t num_units;                  /* as setup's */
  int32_t root_unit;                  /* as setup's */
  const int32_t* parameter_units;     /* as setup's */
  const int64_t* parameter_rows;      /* as setup's */
  int64_t shard_ranks;                /* ranks of the shard group (1 unsharded) */
  int64_t replicate_ranks;            /* ranks of the replicate group */
} meshrun_strategy_plan_input;

/* A strategy's prediction of one rank's memory (ABI 1.6). */
typedef struct meshrun_strategy_memory_plan {
  size_t struct_size;
  /* float32 elements of the parameters the rank's optimizer updates (a
   * sharded strategy's local shard, padding included; every parameter for
   * a replicated one); as many gradients go with them. */
  int64_t local_numel;
  /* Bytes the strategy allocates at setup and holds between steps (what
   * memory() reports as `buffers` after a step that gathered nothing
   * since), e.g. Megatron-FSDP's two gather buffers. */
  int64_t buffers_held;
} meshrun_strategy_memory_plan;

/* A piece of a sharded strategy's local shard: `count` elements that are
 * elements [global_begin, global_begin + count) of the flat parameter layout
 * (setup's parameter_offsets) and elements [local_begin, local_begin + count)
 * of local_shard's buffers. Local elements in no segment are padding: zero
 * in parameters and gradients. Over the shard group's ranks the segments
 * cover every parameter element exactly once. */
typedef struct meshrun_shard_segment {
  int64_t parameter; /* index into the setup's parameters */
  int64_t global_begin;
  int64_t local_begin;
  int64_t count;
} meshrun_shard_segment;

struct meshrun_strategy_api {
  size_t struct_size;
  int32_t mesh_family; /* MESHRUN_MESH_FAMILY_* */
  const meshrun_extension* extensions;

  /* ---- ABI 1.2 ---- */

  /* Prepares the strategy (buckets, shards) over `setup`. Once per instance.
   * A sharded strategy's setup is collective over the data-parallel
   * communicator: it takes its shard of data-parallel rank 0's `parameters`
   * (the full weights are borrowed for this call only), so every rank must
   * call it. Errors: INVALID_ARGUMENT (bad setup, an option the strategy
   * rejects, naming the key), FAILED_PRECONDITION (called twice). */
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

  /* ---- ABI 1.3: sharded strategies; NULL in replicated ones ----
   *
   * With these set, setup's `parameters` holds the initial full weights and
   * both setup buffers are borrowed for the setup call only: the strategy
   * copies its shard out, and the host may free them. Units are numbered as
   * in the setup; an out-of-range unit is OUT_OF_RANGE, a call out of the
   * order above FAILED_PRECONDITION. */

  /* Returns when the unit's full parameters are in place (gathered now, or
   * still gathered, or prefetched earlier); may start prefetching the units
   * that follow. Collective over the shard group. */
  meshrun_error* (*pre_forward)(meshrun_plugin_instance* instance, int32_t unit);
  /* The unit's forward is done; the strategy may reshard it. */
  meshrun_error* (*post_forward)(meshrun_plugin_instance* instance, int32_t unit);
  /* As pre_forward, and the unit's gradient buffer is ready: zero on the
   * step's first backward, else holding the gradients accumulated so far. */
  meshrun_error* (*pre_backward)(meshrun_plugin_instance* instance, int32_t unit);
  /* The unit's gradients are final for this backward; on a sync micro-batch
   * (or always, when gradients are not deferred) the strategy starts their
   * reduce-scatter into the local shard, then may reshard the unit. */
  meshrun_error* (*post_backward)(meshrun_plugin_instance* instance, int32_t unit);
  /* Flat float32 views of the unit's full parameters and gradients: its
   * parameters in index order, each contiguous, no gaps. Owned by the
   * strategy, valid until the unit's next post_forward or post_backward.
   * `gradients` gets data NULL outside the unit's backward. Either pointer
   * may be NULL. FAILED_PRECONDITION when the unit is not gathered. */
  meshrun_error* (*unit_views)(meshrun_plugin_instance* instance, int32_t unit,
                               DLTensor* parameters, DLTensor* gradients);
  /* Flat float32 views of this rank's shard of the parameters and of their
   * gradients, the same length; owned by the strategy, valid until it is
   * destroyed. The host zeroes the gradients before a step's first
   * micro-batch; after finish_gradients they hold the sum, over the step's
   * micro-batches, of the data-parallel average; the host then updates the
   * parameters in place (its optimizer step). */
  meshrun_error* (*local_shard)(meshrun_plugin_instance* instance, DLTensor* parameters,
                                DLTensor* gradients);
  /* Writes up to `capacity` segments of the local shard, in local order, to
   * `segments` (NULL with capacity 0 asks for the count) and their number to
   * *count. */
  meshrun_error* (*shard_segments)(meshrun_plugin_instance* instance,
                                   meshrun_shard_segment* segments, int64_t capacity,
                                   int64_t* count);
  /* Fills `full` (float32, every parameter element, the setup's layout) with
   * the current parameters on every rank of the shard group, e.g. for a
   * consolidated export. Collective over the shard group; outside a step. */
  meshrun_error* (*gather_parameters)(meshrun_plugin_instance* instance, DLTensor* full);

  /* ---- ABI 1.6 ---- */

  /* Nonzero when setup takes MESHRUN_INITIAL_WEIGHTS_BY_SHARD; a sharded
   * table only. */
  int32_t weights_by_shard;
  /* Writes into *out (out->struct_size set by the caller) what a rank of
   * `input` will hold (the rank that holds the most), on an instance that
   * is never set up: `meshrun plan` prints it before any rank runs.
   * Errors: INVALID_ARGUMENT as setup's, for the same input. NULL: the host predicts nothing for a
   * sharded strategy, and every parameter for a replicated one. */
  meshrun_error* (*plan_memory)(meshrun_plugin_instance* instance,
                                const meshrun_strategy_plan_input* input,
                                meshrun_strategy_memory_plan* out);

  /* ---- ABI 1.12 ---- */

  /* A flat bfloat16 view of the unit's full parameters, laid out as
   * unit_views' float32 one and holding the same numbers (each exactly a
   * bfloat16): the all-gather's receive buffer of a strategy gathering in
   * bfloat16, which a model's bfloat16 matmuls read instead of rounding the
   * float32 view again. `parameters` gets data NULL when the strategy holds
   * none (it gathers in another dtype). Owned by the strategy, valid as
   * unit_views'. FAILED_PRECONDITION when the unit is not gathered,
   * OUT_OF_RANGE for a unit out of range. NULL: the strategy holds none. */
  meshrun_error* (*unit_views_bfloat16)(meshrun_plugin_instance* instance, int32_t unit,
                                        DLTensor* parameters);
};

/* The size of the ABI 1.0, 1.2, 1.3, 1.6 and 1.12 strategy tables. */
#define MESHRUN_STRATEGY_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, extensions)
#define MESHRUN_STRATEGY_API_SIZE_1_2 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, memory)
#define MESHRUN_STRATEGY_API_SIZE_1_3 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, gather_parameters)
#define MESHRUN_STRATEGY_API_SIZE_1_6 MESHRUN_STRUCT_SIZE(meshrun_strategy_api, plan_memory)
#define MESHRUN_STRATEGY_API_SIZE_1_12 \
  MESHRUN_STRUCT_SIZE(meshrun_strategy_api, unit_views_bfloat16)
/* The size of the ABI 1.2, 1.3 and 1.6 setup structs. */
#define MESHRUN_STRATEGY_SETUP_SIZE_1_2 MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, extensions)
#define MESHRUN_STRATEGY_SETUP_SIZE_1_3 MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, parameter_rows)
#define MESHRUN_STRATEGY_SETUP_SIZE_1_6 MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, initial_weights)
#define MESHRUN_STRATEGY_SETUP_SIZE_1_13 MESHRUN_STRUCT_SIZE(meshrun_strategy_setup, comm_stream)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_STRATEGY_H_ */
