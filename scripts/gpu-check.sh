#!/usr/bin/env bash
# The GPU machine's one command: builds meshrun's CUDA parts (build-gpu/,
# Release), runs every GPU test (ctest's "gpu: ..." tests) and prints one
# report: the GPUs, then each test's verdict and its own lines (each CUDA
# kernel's largest difference from its CPU twin). Meant to take a few
# minutes on one GPU; on a machine without one every test reports SKIP.
#
#   scripts/gpu-check.sh            # report on stdout; exit 0 when nothing failed
#
# What is checked so far: the toolchain (saxpy), the CUDA twins of the
# embedding, the element-wise layers, (vocabulary-parallel) cross-entropy,
# a mixture's routing, dispatch and combine, rotary and flash-style causal
# GQA attention, forward and backward (models/common/cuda), the cuBLASLt
# bfloat16 GEMM and bfloat16 rounding (plugins/numeric/cuda), the AdamW
# update (trainer/cuda), and the NCCL comm
# backend (its C boundary, and every operation on 2 ranks when the node has
# 2 GPUs).
# Then one benchmark: the GPU's bfloat16 GEMM FLOP/s (an 8192^3 GEMM through
# cuBLASLt) and its device-to-device copy bandwidth. No model computes on a
# GPU yet (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${MESHRUN_GPU_BUILD_DIR:-build-gpu}"
gpu_targets=(meshrun_cuda_smoke meshrun_cuda_layers_test meshrun_cuda_gemm_test meshrun_cuda_adamw_test
  meshrun_gpu_gemm_peak meshrun_nccl_boundary_test meshrun_nccl_comm_test meshrun_comm_nccl
  meshrun_comm_mpi)

echo "== meshrun GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "== GPUs"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: no NVIDIA driver or GPU here"
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "== no CUDA toolkit at /usr/local/cuda: nothing to build"
  exit 1
fi
echo "== build ($build_dir)"
started=$SECONDS
targets=()
for target in "${gpu_targets[@]}"; do targets+=("--target=$target"); done
MESHRUN_BUILD_DIR="$build_dir" scripts/build.sh -DMESHRUN_PLAIN_TIER=ON -DMESHRUN_FULL_SWEEP=OFF \
  "${targets[@]}" >"$build_dir.log" 2>&1 || {
  echo "build failed (last lines of $build_dir.log):"
  tail -30 "$build_dir.log"
  exit 1
}
echo "built in $((SECONDS - started)) s"
echo "== tests"
status=0
ctest --test-dir "$build_dir" -R '^gpu:' -V --timeout 600 >"$build_dir/gpu-tests.log" 2>&1 || status=$?
grep -E '^[0-9]+: (PASS|FAIL|SKIP)|Test +#[0-9]+: |tests passed|not run' "$build_dir/gpu-tests.log" |
  sed -E 's/^[0-9]+: /    /'
echo "== full log: $build_dir/gpu-tests.log"
echo "== benchmark: bfloat16 GEMM peak and copy bandwidth"
timeout 120 "$build_dir/bin/meshrun_gpu_gemm_peak" 8192 2 || echo "benchmark failed or skipped ($?)"
exit $status
