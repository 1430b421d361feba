// The hierarchical path: a communicator whose ranks sit on several nodes,
// the same number L on each (communicator.hpp, Comm::Hierarchy). Each
// collective is split into a part inside every node, which takes the node's
// shared-memory paths, and a part across nodes on 1/L of the data, which
// goes through MPI; the L ranks of a node share the inter-node traffic
// instead of each sending all of it.
//
// Sums and maxima are exact in each part for the integer types, so the
// results match the flat path's bits. For 16-bit floats the node's partial
// sums are rounded to 16 bits before the sum across nodes (the flat path
// rounds once): at most one more rounding, half a 16-bit ulp of the partial
// sum. An average is a sum divided by the communicator's size at the end.
#include <algorithm>
#include <cstring>

#include "collectives.hpp"

namespace meshrun::mpi::hierarchical {
namespace {

// AVG reduces as SUM in the parts; the division comes once at the end.
ReduceOp part_op(ReduceOp op) { return op == ReduceOp::avg ? ReduceOp::sum : op; }

// data[i] /= ranks in place, through the accumulator type in pieces.
void divide(Dtype dtype, std::byte* data, size_t count, int ranks, Scratch& scratch) {
  const size_t bytes = element_bytes(dtype);
  const size_t piece = via_mpi::piece_bytes() / accumulator_bytes(dtype);
  for (size_t done = 0; done < count; done += piece) {
    const size_t n = std::min(piece, count - done);
    std::byte* at = data + done * bytes;
    void* acc = sized(scratch.accumulator, n * accumulator_bytes(dtype));
    combine(dtype, ReduceOp::sum, at, nullptr, acc, n);
    finish(dtype, ReduceOp::avg, ranks, acc, nullptr, {at}, n);
  }
}

// Where the block of member i = n * L + l (node index n, local index l;
// rank rank_at[i]) sits in a buffer gathered across nodes and then within
// the node: ordered by local index, then node index, at l * nodes + n.
size_t transposed(size_t i, size_t nodes, size_t local_size) {
  return (i % local_size) * nodes + i / local_size;
}

}  // namespace

// Reduce-scatter inside the node (local rank l gets chunk l of the node's
// sum), all-reduce of that chunk across nodes, all-gather inside the node.
// The last count % L elements go through the flat MPI path.
void all_reduce(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const Comm& node = *comm.hierarchy->node;
  const Comm& across = *comm.hierarchy->across;
  const size_t bytes = element_bytes(buffers.dtype);
  const auto local_size = static_cast<size_t>(node.size);
  const size_t chunk = buffers.count / local_size;
  const size_t body = chunk * local_size;
  if (chunk > 0) {
    std::byte* mine = buffers.recv + static_cast<size_t>(node.rank) * chunk * bytes;
    mpi::reduce_scatter(node, scratch, {buffers.send, mine, chunk, buffers.dtype}, part_op(op));
    mpi::all_reduce(across, scratch, {mine, mine, chunk, buffers.dtype}, part_op(op));
    mpi::all_gather(node, scratch, {mine, buffers.recv, chunk, buffers.dtype});
    if (op == ReduceOp::avg) divide(buffers.dtype, buffers.recv, body, comm.size, scratch);
  }
  if (body < buffers.count) {
    via_mpi::all_reduce(comm, scratch,
                        {buffers.send + body * bytes, buffers.recv + body * bytes,
                         buffers.count - body, buffers.dtype},
                        op);
  }
}

// All-gather across nodes (each rank fetches its local peers' counterparts
// on the other nodes), then all-gather of those inside the node, then the
// blocks put in rank order: each rank sends its data across nodes once.
void all_gather(const Comm& comm, Scratch& scratch, const Buffers& buffers) {
  const Comm::Hierarchy& hierarchy = *comm.hierarchy;
  const size_t block = buffers.count * element_bytes(buffers.dtype);
  const auto nodes = static_cast<size_t>(hierarchy.across->size);
  const auto ranks = static_cast<size_t>(comm.size);
  std::byte* across_nodes = sized(scratch.ordered_in, nodes * block);
  std::byte* gathered = sized(scratch.ordered_out, ranks * block);
  mpi::all_gather(*hierarchy.across, scratch,
                  {buffers.send, across_nodes, buffers.count, buffers.dtype});
  mpi::all_gather(*hierarchy.node, scratch,
                  {across_nodes, gathered, nodes * buffers.count, buffers.dtype});
  // gathered holds block (l, n) at l * nodes + n.
  const size_t local_size = ranks / nodes;
  for (size_t i = 0; i < ranks; ++i) {
    const auto r = static_cast<size_t>(hierarchy.rank_at[i]);
    std::memcpy(buffers.recv + r * block, gathered + transposed(i, nodes, local_size) * block,
                block);
  }
}

// The send's chunks reordered so that local rank l's share of the node's
// reduce-scatter holds the chunks of every node's local rank l; then
// reduce-scatter inside the node and across nodes: each rank sends its
// node's partial sums across nodes once.
void reduce_scatter(const Comm& comm, Scratch& scratch, const Buffers& buffers, ReduceOp op) {
  const Comm::Hierarchy& hierarchy = *comm.hierarchy;
  const size_t block = buffers.count * element_bytes(buffers.dtype);
  const auto nodes = static_cast<size_t>(hierarchy.across->size);
  const auto ranks = static_cast<size_t>(comm.size);
  const size_t local_size = ranks / nodes;
  std::byte* packed = sized(scratch.ordered_in, ranks * block);
  for (size_t i = 0; i < ranks; ++i) {
    const auto r = static_cast<size_t>(hierarchy.rank_at[i]);
    std::memcpy(packed + transposed(i, nodes, local_size) * block, buffers.send + r * block, block);
  }
  std::byte* node_sums = sized(scratch.ordered_out, nodes * block);
  mpi::reduce_scatter(*hierarchy.node, scratch,
                      {packed, node_sums, nodes * buffers.count, buffers.dtype}, part_op(op));
  mpi::reduce_scatter(*hierarchy.across, scratch,
                      {node_sums, buffers.recv, buffers.count, buffers.dtype}, part_op(op));
  if (op == ReduceOp::avg) divide(buffers.dtype, buffers.recv, buffers.count, comm.size, scratch);
}

}  // namespace meshrun::mpi::hierarchical
