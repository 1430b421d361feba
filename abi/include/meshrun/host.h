/*
 * meshrun/host.h — the host API of libmeshrun, for programs that drive the
 * runtime: the CLI, C/C++ hosts, and other languages through FFI (Python
 * ctypes first: python/meshrun).
 *
 * Lifecycle of a runtime: created (config parsed and validated) -> mesh built
 * (build_mesh, for planning: any world size; or join, as one rank of a
 * running job) -> ... -> destroyed. A call made in the wrong state returns a
 * FAILED_PRECONDITION error; nothing is undefined behaviour.
 *
 * A program that computes its own model (PyTorch, JAX, C) joins the job,
 * runs collectives on the communicators of the mesh axes, and hands its
 * parameters to the configured strategy, calling its hooks around each unit
 * of the model (ABI 1.5, below). Objects it creates from a runtime (a
 * strategy, an operation in flight) keep what they need of it alive: they
 * may be destroyed before or after it.
 *
 * Ownership: every `meshrun_error*` returned is owned by the caller (release
 * with meshrun_error_release). Out-parameters are written only on success.
 * Strings the API returns are owned as each function states.
 *
 * Errors name the call: every message begins with the function that
 * returned it ("meshrun_strategy_create: ..."), then names the argument or
 * key at fault. Handles (runtime, comm, op, strategy) are checked on every
 * call: a NULL, destroyed, never-returned or wrong-typed handle gets
 * INVALID_ARGUMENT and is never dereferenced; destroying a handle twice
 * does nothing the second time. One case cannot be told apart: a destroyed
 * handle whose address a later create of the same type has reused is that
 * new object.
 *
 * Axis names accepted by the mesh queries: "pp", "dp_replicate", "dp_shard",
 * "cp", "tp" (the mesh, outermost first, tp fastest-varying), the flattened
 * "dp", "dp_shard_cp", "dp_cp", and, when distributed.ep_size > 1, the MoE
 * mesh "ep_shard", "ep" (per pipeline stage).
 */
#ifndef MESHRUN_HOST_H_
#define MESHRUN_HOST_H_

#include <dlpack/dlpack.h>
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

/* ---- ABI 1.5: a rank of a running job ---- */

/* Joins the job this process runs in as one rank: reads the launcher's
 * environment (meshrun launch or mpirun, srun, PMI; none: a job of one rank),
 * loads the comm backend the config names (comm.backend) and makes the world
 * communicator, resolves the mesh for the world's size (loading the strategy
 * plugin, and the model plugin when the config has a [model] table), and
 * makes one communicator per mesh axis. With dist_env.backend = "nccl" it
 * first joins the "mpi" backend's world (host memory: meshrun_run_train's
 * own sums, checkpoints, traces), then starts comm.backend's world on the
 * rank's GPU (local rank % the GPUs the process sees) from it. Collective
 * over the job: every rank calls it. Errors: FAILED_PRECONDITION (the mesh
 * is already built), UNAVAILABLE naming the rank when a CUDA run's process
 * sees no GPU, the comm backend's errors, and the mesh's (INVALID_ARGUMENT
 * for sizes that do not fit the world, naming the key). */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_join(meshrun_runtime* runtime);

/* This process's rank in the joined job, the job's size, and its rank among
 * the ranks of its node (0 when the launcher does not say). Any pointer may
 * be NULL. Errors: FAILED_PRECONDITION before join. */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_rank(const meshrun_runtime* runtime,
                                                     int64_t* out_rank, int64_t* out_world_size,
                                                     int64_t* out_local_rank);

/* The communicator of one mesh axis of a joined runtime (axis names as at
 * the top of this header, plus "world"). The handle is owned by the runtime
 * and valid until it is destroyed; strategies and operations made from it
 * keep the communicators themselves alive after that. Errors:
 * FAILED_PRECONDITION before join, NOT_FOUND for an unknown axis. */
typedef struct meshrun_comm meshrun_comm;
MESHRUN_HOST_API meshrun_error* meshrun_runtime_comm(meshrun_runtime* runtime, const char* axis,
                                                     meshrun_comm** out);

/* This process's rank in the communicator and the communicator's size. */
MESHRUN_HOST_API meshrun_error* meshrun_comm_rank(const meshrun_comm* comm, int64_t* out_rank);
MESHRUN_HOST_API meshrun_error* meshrun_comm_size(const meshrun_comm* comm, int64_t* out_size);

/* An operation in flight; opaque, owned by the caller. */
typedef struct meshrun_op meshrun_op;

/* Collectives and point-to-point transfers on caller-owned DLPack tensors,
 * with the semantics of meshrun/comm.h (compact tensors of the backend's
 * device, dtype float32, bfloat16, float16, int32 or int64; `op` one of
 * MESHRUN_REDUCE_*; a send tensor whose data equals the receive tensor's is
 * in place). With out_op NULL a call returns when the operation is done;
 * otherwise it starts the operation and *out_op receives a request to
 * complete with meshrun_op_wait or poll with meshrun_op_test — the tensors'
 * memory must stay valid and untouched until then. The DLTensor structs
 * themselves are borrowed for the call only. Errors: those of the comm
 * backend (INVALID_ARGUMENT for shapes, dtypes or devices it refuses,
 * UNAVAILABLE, DEADLINE_EXCEEDED naming the operation and the rank). */
MESHRUN_HOST_API meshrun_error* meshrun_all_reduce(meshrun_comm* comm, const DLTensor* send,
                                                   DLTensor* recv, int32_t op, meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_all_gather(meshrun_comm* comm, const DLTensor* send,
                                                   DLTensor* recv, meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_reduce_scatter(meshrun_comm* comm, const DLTensor* send,
                                                       DLTensor* recv, int32_t op,
                                                       meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_broadcast(meshrun_comm* comm, DLTensor* tensor,
                                                  int64_t root, meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_send(meshrun_comm* comm, const DLTensor* tensor,
                                             int64_t peer, int64_t tag, meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_recv(meshrun_comm* comm, DLTensor* tensor, int64_t peer,
                                             int64_t tag, meshrun_op** out_op);
MESHRUN_HOST_API meshrun_error* meshrun_barrier(meshrun_comm* comm, meshrun_op** out_op);
/* ABI 1.12: all-to-all with per-rank counts, as comm.h's all_to_all: this
 * rank sends send_counts[r] elements of `send` to rank r (blocks packed in
 * rank order) and receives recv_counts[r] from rank r into `recv`; both
 * arrays have size() entries, read during the call, and recv_counts[r]
 * must equal rank r's send_counts[me]. For expert and context parallelism
 * built by a host. Errors as above, and UNIMPLEMENTED for a comm backend
 * older than ABI 1.7. */
MESHRUN_HOST_API meshrun_error* meshrun_all_to_all(meshrun_comm* comm, const DLTensor* send,
                                                   const int64_t* send_counts, DLTensor* recv,
                                                   const int64_t* recv_counts, meshrun_op** out_op);

/* Blocks until the operation is done and returns its result; timeout < 0
 * uses the comm timeout of the config (comm.timeout_minutes). On expiry:
 * DEADLINE_EXCEEDED, and the operation stays in flight. */
MESHRUN_HOST_API meshrun_error* meshrun_op_wait(meshrun_op* op, double timeout_seconds);
/* *out_done = 1 when the operation is done (wait then returns at once). */
MESHRUN_HOST_API meshrun_error* meshrun_op_test(meshrun_op* op, int32_t* out_done);
/* Releases an operation, first waiting for it up to the comm timeout if it
 * is still in flight; NULL is accepted. */
MESHRUN_HOST_API void meshrun_op_destroy(meshrun_op* op);

/* ---- ABI 1.5: the configured strategy over the caller's parameters ---- */

/* What the caller's model is, for a strategy: its parameters in one order,
 * each contiguous in two caller-owned flat float32 buffers on the runtime's
 * device (host memory; the rank's GPU with a CUDA backend, ABI 1.13) (parameters
 * and gradients, the same layout: parameter i is elements [offset_i,
 * offset_i + numels[i]), offsets cumulative from 0), and the units they form
 * (meshrun/strategy.h: the parameters a sharded strategy gathers together;
 * units other than `root_unit` are layers in forward order, the root
 * encloses them). Borrowed for the create call. */
typedef struct meshrun_strategy_parameters {
  size_t struct_size;
  int64_t num_parameters;
  const char* const* names; /* num_parameters names (checkpoints use them) */
  const int64_t* numels;    /* elements of each parameter */
  const int64_t* rows;      /* size of dim 0 of each (1 for a scalar) */
  const int32_t* units;     /* the unit of each, in [0, num_units) */
  int32_t num_units;
  int32_t root_unit;
  /* The initial values, and their gradients' buffer. A replicated strategy
   * (ddp) works in them until destroyed, so they must stay valid that long;
   * a sharded one (fsdp2) takes its shard during create, after which the
   * caller may free both. */
  DLTensor parameters;
  DLTensor gradients;
  const meshrun_extension* extensions;

  /* ---- ABI 1.13 (read only when struct_size covers it; absent: NULL) ---- */

  /* With a CUDA comm backend (dist_env.backend "nccl") the tensors above are
   * on the rank's GPU (kDLCUDA and its ordinal), and so is every view the
   * strategy lends. `compute_stream` is the cudaStream_t the caller computes
   * on; the runtime sets `comm_stream` on its data-parallel communicators
   * (dp, dp_shard_cp, dp_replicate), so their collectives, the strategy's
   * and any the caller issues on them, run there. NULL is the legacy
   * default stream. Streams are handed over as meshrun/strategy.h (ABI 1.13)
   * says: the strategy's work follows the caller's compute enqueued before
   * each call, and what a call lends is ready for compute enqueued after it.
   * Both are ignored with a CPU backend. Borrowed: valid until the strategy
   * is destroyed. */
  void* compute_stream;
  void* comm_stream;
} meshrun_strategy_parameters;

/* The configured strategy (distributed.strategy, with its [distributed]
 * keys) over the caller's parameters, on the data-parallel communicators of
 * the joined runtime. A sharded strategy takes data-parallel rank 0's
 * initial values. Owned by the caller (destroy with meshrun_strategy_destroy).
 * Collective over the data-parallel ranks. Errors: FAILED_PRECONDITION
 * before join; INVALID_ARGUMENT for a description that does not hold
 * together (naming the field) or a strategy that refuses the config. */
typedef struct meshrun_strategy meshrun_strategy;
MESHRUN_HOST_API meshrun_error* meshrun_strategy_create(meshrun_runtime* runtime,
                                                        const meshrun_strategy_parameters* params,
                                                        meshrun_strategy** out);
/* Destroys a strategy; NULL is accepted. */
MESHRUN_HOST_API void meshrun_strategy_destroy(meshrun_strategy* strategy);

/* *out = 1 when the strategy shards the parameters (then the unit hooks
 * and unit_views apply), 0 when it replicates them. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_sharded(const meshrun_strategy* strategy,
                                                         int32_t* out);

/* The strategy's entry points, in the order meshrun/strategy.h gives:
 * broadcast_parameters once; per step, per micro-batch begin_micro_batch
 * (sync = 1 on the step's last), then its forward and backward — a
 * replicated strategy wants gradient_ready(p) as each parameter's gradient
 * is final, a sharded one pre_/post_forward and pre_/post_backward around
 * each unit — and finish_gradients after the last backward. Errors as the
 * strategy's: FAILED_PRECONDITION out of order, OUT_OF_RANGE for a unit or
 * parameter outside its range, the comm's errors. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_broadcast_parameters(meshrun_strategy* strategy);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_begin_micro_batch(meshrun_strategy* strategy,
                                                                   int32_t sync);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_gradient_ready(meshrun_strategy* strategy,
                                                                int64_t parameter);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_finish_gradients(meshrun_strategy* strategy);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_pre_forward(meshrun_strategy* strategy,
                                                             int32_t unit);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_post_forward(meshrun_strategy* strategy,
                                                              int32_t unit);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_pre_backward(meshrun_strategy* strategy,
                                                              int32_t unit);
MESHRUN_HOST_API meshrun_error* meshrun_strategy_post_backward(meshrun_strategy* strategy,
                                                               int32_t unit);

/* Views of a sharded strategy's gathered unit: its parameters in index order,
 * contiguous, and (inside the unit's backward, else data NULL) their
 * gradients, which the caller accumulates into. 1-D float32 tensors on the
 * buffers' device whose shape arrays the strategy owns; valid until the unit's next
 * post_forward or post_backward. Either pointer may be NULL. Errors:
 * UNIMPLEMENTED for a replicated strategy, FAILED_PRECONDITION when the unit
 * is not gathered. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_unit_views(meshrun_strategy* strategy,
                                                            int32_t unit, DLTensor* parameters,
                                                            DLTensor* gradients);

/* What this rank's optimizer updates: the caller's whole buffers under a
 * replicated strategy, this rank's shard under a sharded one (padding
 * elements stay zero). Views valid until the strategy is destroyed. After
 * finish_gradients the gradients hold the sum over the step's micro-batches
 * of the data-parallel average; the caller zeroes them before a step's first
 * micro-batch and updates the parameters in place. Either pointer may be
 * NULL. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_local_shard(meshrun_strategy* strategy,
                                                             DLTensor* parameters,
                                                             DLTensor* gradients);

/* The squared L2 norm of the whole gradient over every data-parallel rank
 * (for clipping): collective over the shard group. Errors: UNIMPLEMENTED
 * for buffers on a GPU (it reads host memory). */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_gradient_norm_squared(meshrun_strategy* strategy,
                                                                       double* out);

/* Fills `full` (float32, every parameter in the caller's layout, on the
 * buffers' device) with the current parameters; collective over the
 * data-parallel ranks; outside a step. Errors: UNIMPLEMENTED for a
 * replicated strategy's buffers on a GPU (the caller's own buffers hold
 * them). */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_gather_parameters(meshrun_strategy* strategy,
                                                                   DLTensor* full);

/* Saves a sharded checkpoint into the folder `dir` (created; meshrun
 * train's format, docs/checkpoints: every rank writes its part, rank 0
 * index.json last): the local shard's parameters and `num_buffers` more
 * buffers of the local shard's layout named `names` (e.g. an optimizer's
 * moments), with `step`. Collective over the job. Errors: UNIMPLEMENTED for
 * buffers on a GPU (checkpoints read and write host memory). */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_save_checkpoint(meshrun_strategy* strategy,
                                                                 const char* dir, int64_t step,
                                                                 int64_t num_buffers,
                                                                 const char* const* names,
                                                                 const DLTensor* buffers);

/* Loads a checkpoint saved by any world size and strategy over the same
 * parameters (names and sizes) into the local shard and the named buffers;
 * *out_step receives its step. Errors: NOT_FOUND without index.json,
 * INVALID_ARGUMENT for a checkpoint of other parameters or without a named
 * buffer, UNIMPLEMENTED for buffers on a GPU. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_load_checkpoint(
    meshrun_strategy* strategy, const char* dir, int64_t num_buffers, const char* const* names,
    DLTensor* buffers, int64_t* out_step);

/* A piece of the local shard: `count` elements of parameter `parameter` that
 * are elements [global_begin, global_begin + count) of the caller's flat
 * layout and elements [local_begin, local_begin + count) of local_shard's
 * buffers (the fields of meshrun_shard_segment in meshrun/strategy.h). */
typedef struct meshrun_strategy_segment {
  int64_t parameter;
  int64_t global_begin;
  int64_t local_begin;
  int64_t count;
} meshrun_strategy_segment;

/* Which parameter each element of the local shard belongs to, for what an
 * optimizer does per parameter (a weight-decay mask): writes the first
 * min(capacity, count) segments, in local order, to `segments` (NULL with
 * capacity 0 asks for the count) and their number to *out_count. Local
 * elements in no segment are padding. A replicated strategy has one segment
 * per parameter, where it lies in the caller's buffers. Errors:
 * INVALID_ARGUMENT for capacity < 0, or > 0 with segments NULL. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_shard_segments(const meshrun_strategy* strategy,
                                                                meshrun_strategy_segment* segments,
                                                                int64_t capacity,
                                                                int64_t* out_count);

/* ABI 1.12: the bytes the strategy holds for communication and gathered
 * parameters now, the most since it was created, and those plus what it
 * keeps for reuse (metrics.jsonl's mem.buffers, buffers_peak,
 * buffers_reserved). Any pointer may be NULL. */
MESHRUN_HOST_API meshrun_error* meshrun_strategy_memory_use(meshrun_strategy* strategy,
                                                            int64_t* out_buffers,
                                                            int64_t* out_buffers_peak,
                                                            int64_t* out_buffers_reserved);

/* ---- ABI 1.12: the whole of `meshrun train` in the host's process ---- */

/* Hears one step of meshrun_run_train, on every rank: `metrics_json` is the
 * step's JSON object as metrics.jsonl gets it (docs/design.md, "User-facing
 * contract"; "mem" is this rank's own), borrowed for the call. Returns 0 to
 * go on, nonzero to stop after this step: the ranks agree before the next
 * step (one stopping stops all), and the run ends as after its last step.
 * Called on the thread that called meshrun_run_train; it must not call
 * into the runtime. */
typedef int32_t (*meshrun_step_callback)(void* context, const char* metrics_json);

/* Trains as `meshrun train` does, this process being one rank of the
 * joined runtime's job, with the runtime's config (its overrides applied):
 * checks the input as the CLI does before its ranks start, plans, sets up
 * this rank's model, strategy and (pp > 1) pipeline schedule, resumes from
 * checkpoint.resume_from, trains to train.steps with validation, sharded
 * checkpoints (checkpoint.save_every) and, at the end, the consolidated
 * export; rank 0 writes metrics.jsonl, run.json (and trace.json with
 * train.profile) into `output_dir` (NULL: runs/<start time>, the same on
 * every rank). mfu divides by the GEMM peak measured at the start, or the
 * MESHRUN_GEMM_PEAK_FLOPS variable's. Calls `callback` (may be NULL) with
 * `context` after each step. Collective over the job; returns when the run
 * ends, and may be called again (a second run of the same runtime). Never
 * exits the process. Errors: FAILED_PRECONDITION before join, or when a
 * step's loss or gradient norm is not finite and train.skip_nonfinite_steps
 * does not skip it (the message names the step and the first parameter
 * whose gradient is not finite); INVALID_ARGUMENT for bad input, naming the
 * config key; the comm backend's error naming the rank when a peer fails
 * past comm.timeout_minutes; NOT_FOUND for a missing data file or plugin. */
MESHRUN_HOST_API meshrun_error* meshrun_run_train(meshrun_runtime* runtime, const char* output_dir,
                                                  meshrun_step_callback callback, void* context);

/* The trace a host that trains itself records, as `meshrun train` does with
 * train.profile, into the same OUTPUT/trace.json (Chrome's trace event
 * format; `meshrun trace summary` reads it). meshrun_trace_start: collective
 * over the joined job; recording starts at a barrier so that the ranks'
 * timelines line up (FAILED_PRECONDITION before join). meshrun_trace_now:
 * seconds on the trace's clock (a monotonic one), for spans' ends.
 * meshrun_trace_span: records [begin, end) named `name` (copied) of
 * `category`: "step" (a training step), "comm" (blocked on communication
 * compute could have hidden), "idle" (blocked with nothing to compute) or
 * "compute"; nothing while not recording; INVALID_ARGUMENT for another
 * category or an end before the begin. meshrun_trace_write: collective;
 * rank 0 writes every rank's spans to OUTPUT/trace.json (making the
 * folder), and recording stops (FAILED_PRECONDITION when it never
 * started). */
MESHRUN_HOST_API meshrun_error* meshrun_trace_start(meshrun_runtime* runtime);
MESHRUN_HOST_API double meshrun_trace_now(void);
MESHRUN_HOST_API meshrun_error* meshrun_trace_span(const char* name, const char* category,
                                                   double begin_seconds, double end_seconds);
MESHRUN_HOST_API meshrun_error* meshrun_trace_write(meshrun_runtime* runtime,
                                                    const char* output_dir);

/* Writes `path` as the safetensors file `meshrun train` exports (Hugging
 * Face's model.safetensors, written atomically): tensor i is named
 * names[i], has ndims[i] extents taken in turn from `shapes`, and its
 * elements are the next ones of `values` (one flat float32 CPU tensor
 * holding every tensor in order), stored as F32, or rounded to BF16 when
 * `bfloat16` is nonzero. Errors: INVALID_ARGUMENT for a NULL, a negative
 * count or extent, `values` not flat float32 on the CPU, or sizes that do
 * not add up to its length; the write's error naming the file. */
MESHRUN_HOST_API meshrun_error* meshrun_write_safetensors(const char* path, int64_t num_tensors,
                                                          const char* const* names,
                                                          const int32_t* ndims,
                                                          const int64_t* shapes,
                                                          const DLTensor* values, int32_t bfloat16);

/* One rank's GEMM peak in FLOP/s in `dtype` ("float32" or "bfloat16"), what
 * `meshrun train`'s mfu divides by: the MESHRUN_GEMM_PEAK_FLOPS variable's
 * entry for the dtype where it states one, else measured on the calling
 * thread for about `seconds` through the shipped models' GEMMs (ranks
 * measuring at once share their cores, as they will when training). For a
 * host that trains itself and reports mfu. Errors: INVALID_ARGUMENT for
 * another dtype, seconds <= 0, a NULL pointer or a malformed variable
 * (named). */
MESHRUN_HOST_API meshrun_error* meshrun_gemm_peak_flops(const char* dtype, double seconds,
                                                        double* out_flops_per_s);

/* The estimate of the runtime's plan (after build_mesh or join), the object
 * `meshrun plan --estimate --json` prints under "estimate": per-rank memory
 * and step time on `hardware` — "h100-sxm", "h200", "cpu-this-machine"
 * (this machine's GEMM rate and memory bandwidth, measured now, which
 * takes a few tenths of a second) or a .toml profile's path (docs/plan.md)
 * — with `ranks_per_node` ranks sharing a node (0: the profile's, and for
 * cpu-this-machine every rank of the mesh). On success *out_json owns a
 * NUL-terminated string; free it with meshrun_string_destroy. Errors:
 * FAILED_PRECONDITION before the mesh is built; INVALID_ARGUMENT for a
 * NULL argument, a negative ranks_per_node, an unknown profile or a bad key
 * of a profile file (named with its position); NOT_FOUND for a missing
 * profile file. */
MESHRUN_HOST_API meshrun_error* meshrun_runtime_estimate_json(const meshrun_runtime* runtime,
                                                              const char* hardware,
                                                              int64_t ranks_per_node,
                                                              char** out_json);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_HOST_H_ */
