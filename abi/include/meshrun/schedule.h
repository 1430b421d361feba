/*
 * meshrun/schedule.h — the pipeline schedule ABI (plugin kind "schedule").
 *
 * A schedule decides the order of the compute work of every pipeline rank:
 * forward (F), full backward (B), and the input (I) and weight (W) halves of a
 * split backward, per stage and microbatch. The ABI 1.0 table carries the
 * facts the pipeline split needs (stages per rank, placement, whether
 * backward is split). ABI 1.4 appends `generate`, which returns every rank's
 * ordered compute actions; the host adds the sends and receives between
 * ranks itself (lowering), so a schedule author writes compute order only.
 *
 * Actions are PyTorch's action strings (torch.distributed.pipelining):
 * `<stage><type><microbatch>`, e.g. "0F0", "3B1", "2I5", "2W5", with the
 * global stage index and the microbatch counted from 0.
 *
 * Fields after `extensions` of meshrun_schedule_api arrived in ABI 1.4; test
 * them with MESHRUN_HAS_FIELD.
 */
#ifndef MESHRUN_SCHEDULE_H_
#define MESHRUN_SCHEDULE_H_

#include <stddef.h>
#include <stdint.h>

#include "meshrun/error.h"
#include "meshrun/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pipeline stage placement (meshrun_schedule_api.placement): which rank of
 * the pp axis holds global stage s, for pp ranks and v stages per rank. */
#define MESHRUN_PLACEMENT_LOOP 1 /* stage s on rank s mod pp */
#define MESHRUN_PLACEMENT_V 2    /* stages r and 2pp-1-r on rank r (v = 2) */

/* The schedule table. Static: owned by the plugin, valid while it is loaded. */
struct meshrun_schedule_api {
  size_t struct_size;
  int32_t stages_per_rank; /* default virtual stages per rank (1 or 2) */
  int32_t placement;       /* MESHRUN_PLACEMENT_* */
  int32_t splits_backward; /* 1 when backward runs as separate I and W actions */
  const meshrun_extension* extensions;

  /* ---- ABI 1.4 ---- */

  /* Generates every rank's ordered compute actions for `pp` ranks holding
   * `stages_per_rank` stages each (pp * stages_per_rank stages, placed as
   * `placement` says) and `microbatches` microbatches. `options_json` is a
   * JSON object of schedule-specific options, borrowed for the call (NULL
   * reads as "{}"); keys a schedule does not know are ignored.
   *
   * On success *out_actions_json is a NUL-terminated JSON object
   *   {"actions": [["0F0", "0F1", "0B0", ...], ...]}
   * with one array per rank, rank 0 first, each in execution order, holding
   * only F, B, I and W actions; every stage runs F once per microbatch and
   * B, or I then W, once per microbatch. It is allocated with the `allocate`
   * of the host services given to `create`; the caller owns it and frees it
   * with their `deallocate`. On error *out_actions_json is left unchanged.
   *
   * Errors: INVALID_ARGUMENT when `instance` or `out_actions_json` is NULL,
   * `options_json` is not a JSON object, a size is below 1, or the sizes do
   * not fit the schedule (the message names the constraint, e.g.
   * "zbv_zero_bubble needs stages_per_rank == 2 (V placement), got 3");
   * INTERNAL when memory runs out. NULL in a table that cannot generate
   * (the host reports UNIMPLEMENTED). */
  meshrun_error* (*generate)(meshrun_plugin_instance* instance, int64_t pp, int64_t stages_per_rank,
                             int64_t microbatches, const char* options_json,
                             char** out_actions_json);
};

/* The size of the ABI 1.0 and 1.4 schedule tables. */
#define MESHRUN_SCHEDULE_API_SIZE_1_0 MESHRUN_STRUCT_SIZE(meshrun_schedule_api, extensions)
#define MESHRUN_SCHEDULE_API_SIZE_1_4 MESHRUN_STRUCT_SIZE(meshrun_schedule_api, generate)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MESHRUN_SCHEDULE_H_ */
