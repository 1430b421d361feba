// The element types the mpi backend moves, and the arithmetic of its
// reductions. Reductions accumulate in float for the three float types, so
// 16-bit values are summed in float32 and rounded once at the end, and in
// the type itself for the integers (wrapping on overflow, as MPI_SUM does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "meshrun/comm.h"

namespace meshrun::mpi {

enum class Dtype { float32, bfloat16, float16, int32, int64 };

enum class ReduceOp : int32_t {
  sum = MESHRUN_REDUCE_SUM,
  avg = MESHRUN_REDUCE_AVG,
  max = MESHRUN_REDUCE_MAX,
};

size_t element_bytes(Dtype dtype);
const char* dtype_name(Dtype dtype);
const char* reduce_op_name(ReduceOp op);

// Bytes of one accumulator element: 4 for the float types and int32, 8 for
// int64.
size_t accumulator_bytes(Dtype dtype);

// acc[i] = a[i] op b[i], widened to the accumulator type; acc[i] = a[i]
// when b is NULL. AVG combines as SUM.
void combine(Dtype dtype, ReduceOp op, const void* a, const void* b, void* acc, size_t count);
// acc[i] = acc[i] op src[i].
void accumulate(Dtype dtype, ReduceOp op, void* acc, const void* src, size_t count);
// Where a reduction's results go: `dst`, and when `copy` is not NULL the
// same values into `copy` as well, in the same pass, so that nobody reads
// `dst` back to copy it. With `stream` the copy is written with
// non-temporal stores, and the caller calls stream_fence() before anyone
// reads it. `copy` must not overlap `dst`; like `dst`, it may be the memory
// of an input, since every element is read before it is written.
struct Results {
  void* dst;
  void* copy = nullptr;
  bool stream = false;
};

// results[i] = acc[i] op last[i] (acc[i] when last is NULL), divided by
// `ranks` for AVG (integer division for the integer types), narrowed to
// `dtype` with round-to-nearest-even. Folding the last input in here saves a
// pass over the data. `results.dst` may be the memory of `acc` or `last`.
void finish(Dtype dtype, ReduceOp op, int64_t ranks, const void* acc, const void* last,
            const Results& results, size_t count);

// dst = op over the `count` elements of `ranks` inputs: `own`, then
// next(1), ..., next(ranks - 1) in that order, so that whoever reduces the
// same inputs gets the same bits. A pointer from `next` need stay valid only
// until the following call. Float32 and the integers accumulate in their
// own type, so `own` serves as the accumulator until an input is added, and
// with two ranks the whole reduction is one pass (finish folds in the last
// input). `acc` holds `count` accumulator elements; `results.dst` may be
// `own`.
void reduce(Dtype dtype, ReduceOp op, int ranks, const void* own,
            const std::function<const void*(int)>& next, void* acc, const Results& results,
            size_t count);

// Whole cache lines to copy: line i of `src` into line i of `dst`.
struct LineCopy {
  void* dst;
  const void* src;
};

// The step of the shared-memory pipeline on two ranks, in one loop over
// `lines` cache lines: the reduction of `own` and then `input` (reduce()'s
// order, so its bits) into `results`, and line i of `copy_in` (plain
// stores) and of `copy_out` (streamed like the results when
// `results.stream`) after line i of the results. One loop keeps the core's
// loads and stores of all three in flight together: 8-10% faster on 2 ranks
// here than three loops, and no faster in calls per 4 KiB block.
// `results.copy` must not be NULL; when streamed, it and `copy_out.dst` must
// be line-aligned. Nothing may overlap but `results.dst` and `own`.
void reduce_two_lines(Dtype dtype, ReduceOp op, const void* own, const void* input,
                      const Results& results, size_t lines, const LineCopy& copy_in,
                      const LineCopy& copy_out);

}  // namespace meshrun::mpi
