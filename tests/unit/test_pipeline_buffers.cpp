// The pipeline executor's activation buffers, with and without the pool of
// received buffers (distributed.pipeline.pp_recv_buffer_pool).
#include <catch2/catch.hpp>

#include "pipeline/buffers.hpp"

namespace meshrun::pipeline {
namespace {

BufferKey input(int32_t microbatch) { return {BufferKind::input, 1, microbatch}; }

TEST_CASE("pipeline buffers: a pool hands received buffers out again, up to the receive depth",
          "[pipeline]") {
  ActivationBuffers buffers(true);
  float* first = buffers.receive(input(0), 8);
  float* second = buffers.receive(input(1), 8);
  buffers.release(input(0));
  buffers.release(input(1));
  CHECK(buffers.pooled_bytes() == 2 * 8 * 4);
  CHECK(buffers.allocations() == 2);

  // The next step's receives take the pooled buffers, values and all.
  first[3] = 7.0f;
  float* again = buffers.receive(input(2), 8);
  CHECK((again == first || again == second));
  CHECK(buffers.allocations() == 2);
  // Another size is allocated; computed outputs are never pooled.
  buffers.receive(input(3), 4);
  buffers.allocate({BufferKind::output, 1, 0}, 8);
  CHECK(buffers.allocations() == 4);
  buffers.release({BufferKind::output, 1, 0});
  CHECK(buffers.pooled_bytes() == 8 * 4);

  // At most as many as were held at once (2 so far) stay pooled: the
  // size-4 buffer comes back to a full pool and is freed.
  buffers.release(input(2));
  buffers.release(input(3));
  CHECK(buffers.pooled_bytes() == 2 * 8 * 4);
  buffers.receive(input(4), 8);
  buffers.receive(input(5), 8);
  buffers.receive(input(6), 8);
  for (int32_t mb : {4, 5, 6}) buffers.release(input(mb));
  CHECK(buffers.live() == 0);
  CHECK(buffers.pooled_bytes() == 3 * 8 * 4);
}

TEST_CASE("pipeline buffers: without a pool a released buffer is freed", "[pipeline]") {
  ActivationBuffers buffers;
  buffers.receive(input(0), 8);
  buffers.release(input(0));
  buffers.receive(input(1), 8);
  CHECK(buffers.pooled_bytes() == 0);
  CHECK(buffers.allocations() == 2);
}

}  // namespace
}  // namespace meshrun::pipeline
