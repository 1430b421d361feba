/*
 * meshrun/comm.h — the communication backend ABI (plugin kind "comm").
 *
 * A comm plugin (meshrun_comm_mpi.so, meshrun_comm_nccl.so, ...) moves DLPack
 * tensors between the ranks of a job. The host makes one world communicator,
 * splits it into one communicator per mesh axis, and issues collectives and
 * point-to-point transfers on them.
 *
 * Asynchrony: every operation takes `meshrun_request** out_request`. With a
 * non-NULL out_request the call only starts the operation and returns a
 * request the caller completes with `wait` or polls with `test`, so that
 * communication overlaps compute. With NULL the call returns when the
 * operation is complete. Every rank of a communicator must issue that
 * communicator's collectives in the same order; ranks that share several
 * communicators must issue all of their collectives in the same order (as
 * with NCCL on one stream).
 *
 * Tensors: `DLTensor` views, borrowed for the call only (the backend copies
 * the struct), but the memory they point to must stay valid and untouched
 * until the request completes. Tensors must be compact (strides NULL or
 * row-major contiguous), on the backend's device type, of dtype float32,
 * bfloat16, float16, int32 or int64. A send tensor whose data pointer equals
 * the receive tensor's means "in place". Reductions of 16-bit floats
 * accumulate in float32 where the engine has no native 16-bit reduction.
 *
 * Errors: INVALID_ARGUMENT (NULL, shape, dtype, device, rank or op out of
 * range), UNAVAILABLE (a peer is gone), DEADLINE_EXCEEDED (the timeout
 * expired; the message names the operation, the communicator and the rank),
 * INTERNAL (the engine failed).
 */
#ifndef MESHRUN_COMM_H_
#define MESHRUN_COMM_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A group of ranks that communicate; opaque, owned by the comm plugin. */
typedef struct meshrun_communicator meshrun_communicator;
/* An operation in flight; opaque, owned by the comm plugin. */
typedef struct meshrun_request meshrun_request;

/* Reduction operators (int32_t). AVG divides the sum by the communicator
 * size (integer division for int32/int64). */
#define MESHRUN_REDUCE_SUM 0
#define MESHRUN_REDUCE_AVG 1
#define MESHRUN_REDUCE_MAX 2

/* How the ranks of a job meet before a backend's own world exists, made by
 * the host (e.g. from the CPU backend) for backends that need it (NCCL shares
 * its unique id through it). Borrowed for the `world` call only. */
typedef struct meshrun_bootstrap {
  size_t struct_size;
  int64_t rank; /* this process's rank in the job */
  int64_t size; /* number of ranks in the job */
  void* context;
  /* Copies `bytes` at `data` on rank `root` into `data` on every rank;
   * returns when done. */
  meshrun_error* (*broadcast)(void* context, void* data, size_t bytes, int64_t root);
} meshrun_bootstrap;

/* Options for the world communicator; borrowed for the `world` call only. */
typedef struct meshrun_comm_options {
  size_t struct_size;
  /* Default limit for `wait` (comm.timeout_minutes * 60); <= 0: no limit. */
  double timeout_seconds;
  /* CUDA device ordinal for device backends; ignored by CPU backends. */
  int32_t device_id;
  const meshrun_extension* extensions;
} meshrun_comm_options;

/* The comm plugin's table (meshrun_plugin_api.comm). Fields after
 * `extensions` arrived in ABI 1.1; test them with MESHRUN_HAS_FIELD. */
struct meshrun_comm_api {
  size_t struct_size;
  /* DLDeviceType of the tensors it moves (1 = kDLCPU, 2 = kDLCUDA). */
  int32_t device_type;
  const meshrun_extension* extensions;

  /* ---- ABI 1.1 ---- */

  /* Makes the world communicator of every rank of the job; collective over
   * the job. `bootstrap` may be NULL for backends that find their peers
   * themselves (MPI under mpirun). On success *out is owned by the caller
   * (destroy with communicator_destroy before the instance). */
  meshrun_error* (*world)(meshrun_plugin_instance* instance, const meshrun_bootstrap* bootstrap,
                          const meshrun_comm_options* options, meshrun_communicator** out);
  /* Splits `parent`: ranks passing the same `color` form one new
   * communicator, ordered by `key` (then by parent rank). Collective over
   * `parent`. `name` (e.g. "dp") is copied and used in messages. */
  meshrun_error* (*split)(meshrun_communicator* parent, int64_t color, int64_t key,
                          const char* name, meshrun_communicator** out);
  /* Destroys a communicator after its requests are destroyed; NULL accepted. */
  void (*communicator_destroy)(meshrun_communicator* communicator);
  /* This process's rank in the communicator, and the communicator's size. */
  meshrun_error* (*rank)(const meshrun_communicator* communicator, int64_t* out_rank);
  meshrun_error* (*size)(const meshrun_communicator* communicator, int64_t* out_size);
  /* Sets the CUDA stream (cudaStream_t) later operations are ordered on;
   * NULL is the default stream. CPU backends accept and ignore it. */
  meshrun_error* (*set_stream)(meshrun_communicator* communicator, void* stream);

  /* recv = op over ranks of send; same shape and dtype on every rank. */
  meshrun_error* (*all_reduce)(meshrun_communicator* communicator, const DLTensor* send,
                               DLTensor* recv, int32_t op, meshrun_request** out_request);
  /* recv = concatenation of every rank's send in rank order;
   * numel(recv) = size * numel(send). */
  meshrun_error* (*all_gather)(meshrun_communicator* communicator, const DLTensor* send,
                               DLTensor* recv, meshrun_request** out_request);
  /* recv = chunk `rank` of op over ranks of send;
   * numel(send) = size * numel(recv). */
  meshrun_error* (*reduce_scatter)(meshrun_communicator* communicator, const DLTensor* send,
                                   DLTensor* recv, int32_t op, meshrun_request** out_request);
  /* tensor on every rank = tensor on `root`. */
  meshrun_error* (*broadcast)(meshrun_communicator* communicator, DLTensor* tensor, int64_t root,
                              meshrun_request** out_request);
  /* Point to point: `tensor` to / from `peer` (a rank of the communicator);
   * a send matches the recv of the same tag, in order. */
  meshrun_error* (*send)(meshrun_communicator* communicator, const DLTensor* tensor, int64_t peer,
                         int64_t tag, meshrun_request** out_request);
  meshrun_error* (*recv)(meshrun_communicator* communicator, DLTensor* tensor, int64_t peer,
                         int64_t tag, meshrun_request** out_request);
  /* Completes when every rank of the communicator has entered it. */
  meshrun_error* (*barrier)(meshrun_communicator* communicator, meshrun_request** out_request);

  /* Blocks until the request completes and returns the operation's result.
   * `timeout_seconds` < 0 uses the world's timeout; on expiry returns
   * DEADLINE_EXCEEDED and the request stays in flight. May be called again
   * after it returned; the request stays owned by the caller. */
  meshrun_error* (*wait)(meshrun_request* request, double timeout_seconds);
  /* *out_done = 1 when the request has completed (wait then returns at
   * once), else 0. */
  meshrun_error* (*test)(meshrun_request* request, int32_t* out_done);
  /* Releases a request, first waiting up to the world's timeout if it is
   * still in flight (a request that then never completes is leaked rather
   * than freed under the engine); NULL accepted. */
  void (*request_destroy)(meshrun_request* request);

  /* ---- ABI 1.7 (test with MESHRUN_HAS_FIELD) ---- */

  /* All-to-all with per-rank counts (MPI_Alltoallv with packed blocks):
   * each rank sends send_counts[r] elements of `send` to rank r, the blocks
   * one after another in rank order, and receives recv_counts[r] elements
   * from rank r into `recv`, likewise. Both arrays have size() entries and
   * are read during the call; recv_counts[r] must equal rank r's
   * send_counts[me] (the callers exchange counts first, e.g. with an
   * all_to_all of one count per rank). send and recv are contiguous, of
   * one dtype, and do not overlap. Mixture-of-experts dispatch and combine
   * use it. Errors: INVALID_ARGUMENT (NULL, a negative count, counts past
   * the tensors, dtypes that differ, overlapping buffers, a backend's size
   * limit: the MPI backend's 2^31 - 1 bytes per operation). */
  meshrun_error* (*all_to_all)(meshrun_communicator* communicator, const DLTensor* send,
                               const int64_t* send_counts, DLTensor* recv,
                               const int64_t* recv_counts, meshrun_request** out_request);
};

/* The size of the ABI 1.0 and 1.1 comm tables. */
#define MESHRUN_COMM_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_comm_api, extensions)
#define MESHRUN_COMM_API_SIZE_1_1 MESHRUN_STRUCT_SIZE(meshrun_comm_api, request_destroy)
/* The size of the ABI 1.7 comm table, with all_to_all. */
#define MESHRUN_COMM_API_SIZE_1_7 MESHRUN_STRUCT_SIZE(meshrun_comm_api, all_to_all)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_COMM_H_ */
