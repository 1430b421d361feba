// Checks of what callers hand the backend, turned into INVALID_ARGUMENT
// errors whose message begins with the operation they concern, e.g.
// "all_reduce on communicator 'tp' (size 2, world rank 3): recv has 12
// elements, send 16; they must be equal".
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtype.hpp"

namespace meshrun::mpi {

// A validated tensor: its memory, element count and type.
struct View {
  std::byte* data;
  size_t numel;
  Dtype dtype;
  size_t bytes() const { return numel * element_bytes(dtype); }
};

// `tensor` (called `role` in messages) as a View: non-NULL, on the CPU, of a
// supported dtype, compact, with data unless empty.
View view_of(const DLTensor* tensor, const std::string& what, const char* role);

ReduceOp reduce_op_of(int32_t op, const std::string& what);
// `value` as a rank of a communicator of `size` ranks.
int rank_of(int64_t value, int size, const std::string& what, const char* role);
// `value` as an int in [0, upper].
int bounded_int(int64_t value, int upper, const std::string& what, const char* role);

void require_same_dtype(const View& send, const View& recv, const std::string& what);
// tensor.numel == expected; `rule` (e.g. "numel(recv) = size * numel(send)")
// says why in the message.
void require_numel(const View& tensor, const char* role, size_t expected, const char* rule,
                   const std::string& what);
// send and recv are the same memory or do not overlap.
void require_same_or_disjoint(const View& send, const View& recv, const std::string& what);

// Throws INVALID_ARGUMENT "<what>: <problem>".
[[noreturn]] void invalid(const std::string& what, const std::string& problem);

}  // namespace meshrun::mpi
