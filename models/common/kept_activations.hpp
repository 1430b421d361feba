// The activations a bfloat16 run keeps for its backward in bfloat16, as
// torch's FSDP2 mixed precision and autocast keep theirs: a layer's or the
// head's matmul outputs, norm outputs and activation functions' outputs
// (what a family's low_precision() names) are computed in float32 into
// working buffers the stage lends, rounded to bfloat16 (nearest even) when
// the forward is done, and widened back into the working buffers for the
// backward. The norms' statistics, attention's log-sum-exps, the loss's
// softmax and the router's probabilities stay float32 (docs/design.md,
// "Which tensors are kept in which dtype"). Rounding what a bfloat16 GEMM
// reads changes nothing (it rounds its operands alike); an element-wise
// backward (a norm's, SwiGLU's, attention's) reads the rounded values.
#pragma once

#include <cstdint>
#include <vector>

#include "common/buffer.hpp"
#include "common/compute.hpp"

namespace meshrun::models {

// Buffers of one kind of activations (a layer's, the head's), in
// low_precision()'s order; null where a layer keeps none (what selective
// checkpointing recomputes).
using LowPrecisionBuffers = std::vector<Buffer<float>*>;
// Their bfloat16 copies, in the same order, in their compute's memory.
using BfloatCopies = std::vector<Buffer<uint16_t>>;

// The float32 working buffers of one kind of activations, lent to one
// forward or backward at a time, in `compute`'s memory (which computes the
// roundings and widenings).
class KeptInBfloat16 {
 public:
  // `sizes`: the floats each buffer holds when the activations are built
  // (a buffer a forward sizes itself, as a mixture's experts', may say 0).
  KeptInBfloat16(std::vector<size_t> sizes, Compute& compute);

  // Before a forward: each buffer gets a working buffer of its size.
  void lend(const LowPrecisionBuffers& buffers);
  // After it: each buffer rounded into `copies` (which grow as needed) and
  // its working buffer taken back, leaving it empty.
  void keep(const LowPrecisionBuffers& buffers, BfloatCopies& copies);
  // Before the backward: each buffer gets a working buffer holding its
  // copy widened.
  void restore(const LowPrecisionBuffers& buffers, const BfloatCopies& copies);
  // After the backward: the working buffers taken back (one the backward
  // moved away is allocated again when next lent).
  void take_back(const LowPrecisionBuffers& buffers);

 private:
  Compute& compute_;
  std::vector<Buffer<float>> working_;
  std::vector<size_t> sizes_;
};

// Each buffer emptied, its memory freed (null ones skipped).
void release(const LowPrecisionBuffers& buffers);

// Each buffer rounded to bfloat16 in place (by its compute): what keeping
// it in bfloat16 leaves for the backward.
void round_to_bfloat16(const LowPrecisionBuffers& buffers);

// `buffer` rounded to bfloat16 in place on `compute` when `bfloat16` (a
// pass's bfloat16_activations): a layer's forward rounds so a kept buffer
// that an element-wise op reads after it (common/stage.hpp).
void round_kept(bool bfloat16, Buffer<float>& buffer, Compute& compute = host_compute());

// Bytes of `copies`.
int64_t bytes_of_copies(const BfloatCopies& copies);

}  // namespace meshrun::models
