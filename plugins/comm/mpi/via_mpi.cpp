// The MPI path: small collectives, and every collective of a communicator
// that spans nodes or whose ranks cannot read each other's memory. Large
// buffers go in pieces (see collectives.hpp).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives.hpp"

namespace meshrun::mpi::via_mpi {
namespace {

// Open MPI 4.1's MPI_Allreduce runs at 3-7 GB/s up to 16 MiB on one node
// but falls to 0.3 GB/s at 64 MiB (docs/design.md, "Measured"); 4 MiB pieces stay on the
// fast side.
constexpr size_t kDefaultPieceBytes = size_t{4} << 20;

MPI_Datatype accumulator_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::int32:
      return MPI_INT32_T;
    case Dtype::int64:
      return MPI_INT64_T;
    default:
      return MPI_FLOAT;
  }
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

// `bytes` of contiguous data, spaced `stride` bytes apart when repeated: one
// rank's slot of a piece of an all_gather. Freed with the object.
class StridedBytes {
 public:
  StridedBytes(size_t bytes, size_t stride) {
    MPI_Datatype contiguous = MPI_DATATYPE_NULL;
    check_mpi(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &contiguous),
              "MPI_Type_contiguous");
    const int rc = MPI_Type_create_resized(contiguous, 0, static_cast<MPI_Aint>(stride), &type_);
    MPI_Type_free(&contiguous);
    check_mpi(rc, "MPI_Type_create_resized");
    check_mpi(MPI_Type_commit(&type_), "MPI_Type_commit");
  }
  ~StridedBytes() { MPI_Type_free(&type_); }
  StridedBytes(const StridedBytes&) = delete;
  StridedBytes& operator=(const StridedBytes&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

}  // namespace

size_t piece_bytes() {
  // At least 64 bytes, so that a piece holds whole accumulator elements; at
  // most what an MPI count can say.
  static const size_t bytes = std::clamp<size_t>(
      bytes_from_environment("MESHRUN_MPI_PIECE_BYTES", kDefaultPieceBytes), 64, INT_MAX);
  return bytes;
}

// Float32 and the integers reduce in place in recv; 16-bit floats are
// widened piece by piece into a float32 buffer, reduced, and rounded back.
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const size_t bytes = element_bytes(buffers.dtype);
  const size_t acc_bytes = accumulator_bytes(buffers.dtype);
  const bool widened = acc_bytes != bytes;
  const size_t piece = piece_bytes() / acc_bytes;
  for (size_t done = 0; done < buffers.count; done += piece) {
    const size_t count = std::min(piece, buffers.count - done);
    const std::byte* in = buffers.send + done * bytes;
    std::byte* out = buffers.recv + done * bytes;
    void* acc = widened ? sized(scratch.accumulator, count * acc_bytes) : out;
    if (widened) combine(buffers.dtype, op, in, nullptr, acc, count);
    const void* source = widened || in == out ? MPI_IN_PLACE : in;
    check_mpi(MPI_Allreduce(source, acc, static_cast<int>(count), accumulator_type(buffers.dtype),
                            mpi_op(op), comm.comm),
              "MPI_Allreduce");
    finish(buffers.dtype, op, comm.size, acc, nullptr, {out}, count);
  }
}

// Piece k of every rank's send lands at offset k of each rank's slot: the
// receive type spaces the slots one send size apart.
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers) {
  const size_t bytes = buffers.count * element_bytes(buffers.dtype);
  const std::byte* send = buffers.send;
  if (overlaps(send, bytes, buffers.recv, bytes * static_cast<size_t>(comm.size))) {
    send = static_cast<std::byte*>(std::memcpy(sized(scratch.staged, bytes), send, bytes));
  }
  const size_t piece = std::max<size_t>(1, piece_bytes() / static_cast<size_t>(comm.size));
  for (size_t done = 0; done < bytes; done += piece) {
    const size_t length = std::min(piece, bytes - done);
    const StridedBytes slot(length, bytes);
    check_mpi(MPI_Allgather(send + done, static_cast<int>(length), MPI_BYTE, buffers.recv + done, 1,
                            slot.get(), comm.comm),
              "MPI_Allgather");
  }
}

// Each piece packs the matching part of every rank's chunk side by side (in
// the accumulator type), so that MPI_Reduce_scatter_block hands rank r the
// reduced part of chunk r.
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const size_t bytes = element_bytes(buffers.dtype);
  const size_t acc_bytes = accumulator_bytes(buffers.dtype);
  const size_t ranks = static_cast<size_t>(comm.size);
  const bool in_place =
      overlaps(buffers.send, buffers.count * bytes * ranks, buffers.recv, buffers.count * bytes);
  std::byte* dst = in_place ? sized(scratch.staged, buffers.count * bytes) : buffers.recv;
  const size_t piece = std::max<size_t>(1, piece_bytes() / (ranks * acc_bytes));
  for (size_t done = 0; done < buffers.count; done += piece) {
    const size_t count = std::min(piece, buffers.count - done);
    std::byte* packed = sized(scratch.incoming, ranks * count * acc_bytes);
    std::byte* reduced = sized(scratch.accumulator, count * acc_bytes);
    for (size_t q = 0; q < ranks; ++q) {
      combine(buffers.dtype, op, buffers.send + (q * buffers.count + done) * bytes, nullptr,
              packed + q * count * acc_bytes, count);
    }
    check_mpi(MPI_Reduce_scatter_block(packed, reduced, static_cast<int>(count),
                                       accumulator_type(buffers.dtype), mpi_op(op), comm.comm),
              "MPI_Reduce_scatter_block");
    finish(buffers.dtype, op, comm.size, reduced, nullptr, {dst + done * bytes}, count);
  }
  if (in_place) std::memcpy(buffers.recv, dst, buffers.count * bytes);
}

void broadcast(const Comm& comm, const Buffers& buffers, int root) {
  const size_t bytes = buffers.count * element_bytes(buffers.dtype);
  for (size_t done = 0; done < bytes; done += piece_bytes()) {
    const size_t length = std::min(piece_bytes(), bytes - done);
    check_mpi(MPI_Bcast(buffers.recv + done, static_cast<int>(length), MPI_BYTE, root, comm.comm),
              "MPI_Bcast");
  }
}

}  // namespace meshrun::mpi::via_mpi
