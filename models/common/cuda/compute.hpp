// A CUDA GPU's compute (common/compute.hpp): the CUDA twins of the layer
// kernels (common/cuda/layers.hpp, attention.hpp, experts.hpp) and
// cuBLASLt's GEMMs (numeric/cuda/gemm.hpp), every call enqueued on one
// stream.
//
// This code has compiled but never run on a GPU (docs/testing.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "common/compute.hpp"
#include "numeric/gemm.hpp"

namespace meshrun::models {

// The compute of GPU `device` (made the calling thread's current device,
// which the calls expect it still is), on `stream` (the caller's; it must
// outlive the compute). Its calls throw
// std::runtime_error naming the call and the CUDA or cuBLAS error. Throws
// std::runtime_error when the cuBLASLt handle or its workspace cannot be
// made (naming the device and the bytes asked for). Its GEMMs compute in
// the precision `precision` returns at each call.
std::unique_ptr<Compute> make_cuda_compute(
    int device, cudaStream_t stream, MatmulPrecisionSource precision = &kernels::matmul_precision);

}  // namespace meshrun::models
