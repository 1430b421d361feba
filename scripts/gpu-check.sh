#!/usr/bin/env bash
# The GPU machine's one command: builds meshrun's CUDA parts (build-gpu/,
# Release), runs every GPU test (ctest's "gpu: ..." tests) and prints one
# report: the GPUs, then each test's verdict and its own lines (each CUDA
# kernel's largest difference from its CPU twin). Meant to take a few
# minutes on one GPU; on a machine without one every test reports SKIP.
#
#   scripts/gpu-check.sh            # report on stdout; exit 0 when nothing failed
#
# On a GPU machine without meshrun's Debian build dependencies (the device
# tool's image: CUDA, CMake, ninja, g++, Python, no package registry), run
# `scripts/gpu-deps.sh fetch` here first and carry .gpu-deps/: this script
# unpacks and uses them (never into /). NCCL is taken from the toolkit, or
# else from Python's nvidia-nccl package where the image has one.
#
# What is checked so far: the toolchain (saxpy), the CUDA twins of the
# embedding, the element-wise layers, (vocabulary-parallel) cross-entropy,
# a mixture's routing, dispatch and combine, rotary and flash-style causal
# GQA attention, forward and backward (models/common/cuda), the cuBLASLt
# bfloat16 GEMM and bfloat16 rounding (plugins/numeric/cuda), the AdamW
# update and the trainer's state device (trainer/cuda), the GPU's layer
# compute, a kit stage and the shipped model plugins on the GPU, the NCCL
# comm backend (its C boundary, and every operation on 2 ranks when the
# node has 2 GPUs), ddp and fsdp2 on GPU buffers over NCCL against the same
# on host buffers (1 rank; 2 where the node has 2 GPUs and MPI), and
# `meshrun train` on GPUs against the CPU run of the same configs step by
# step (needs mpirun; 2-rank cases where there are 2 GPUs).
# Then one benchmark, `meshrun bench peak --device cuda`: the GPU's bfloat16
# GEMM FLOP/s (an 8192^3 GEMM through cuBLASLt) and its device-to-device
# copy bandwidth. docs/testing.md says which of these has run on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${MESHRUN_GPU_BUILD_DIR:-build-gpu}"
gpu_targets=(meshrun_cuda_smoke meshrun_cuda_layers_test meshrun_cuda_gemm_test meshrun_cuda_compute_test
  meshrun_cuda_kit_stage_test meshrun_cuda_model_plugins_test meshrun_model_llama meshrun_model_gpt2
  meshrun_model_mixtral meshrun_kit_cuda
  meshrun_cuda_state_device_test meshrun_cli meshrun_cuda_peak meshrun_nccl_boundary_test meshrun_nccl_comm_test
  meshrun_strategy_device_test meshrun_strategy_ddp meshrun_strategy_fsdp2 meshrun_comm_nccl
  meshrun_comm_mpi test_plugin_loopback meshrun_trainer_cuda meshrun_sidecar_llama
  meshrun_strategy_megatron_fsdp)

echo "== meshrun GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "== GPUs"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: no NVIDIA driver or GPU here"
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
if [ ! -x "$nvcc" ]; then
  echo "== no CUDA compiler (nvcc on PATH or in /usr/local/cuda): nothing to build"
  exit 1
fi
# Warnings stay warnings here: the GPU machine's g++ and nvcc may be newer
# than CI's and warn where CI's do not, and a GPU session is too short to
# lose to that. CI builds the same code with -Werror.
configure=(-DMESHRUN_PLAIN_TIER=ON -DMESHRUN_FULL_SWEEP=OFF -DMESHRUN_WERROR=OFF
  "-DCMAKE_CUDA_COMPILER=$nvcc")
if compgen -G ".gpu-deps/*.deb" >/dev/null; then
  echo "== Debian build dependencies from .gpu-deps/"
  # shellcheck source=gpu-deps.sh
  source scripts/gpu-deps.sh use
fi
nccl_python="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
  2>/dev/null || true)"
if ! ls "$(dirname "$nvcc")"/../lib*/libnccl.so* >/dev/null 2>&1 && [ -n "$nccl_python" ]; then
  nccl_library="$(ls "$nccl_python"/lib/libnccl.so* | head -1)"
  configure+=("-DMESHRUN_NCCL_LIBRARY=$nccl_library" "-DMESHRUN_NCCL_INCLUDE_DIR=$nccl_python/include")
  export LD_LIBRARY_PATH="$nccl_python/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "NCCL from Python's nvidia-nccl: $nccl_library"
fi
echo "== build ($build_dir)"
started=$SECONDS
# Configure with the first target, then build those of the others this
# machine's toolkit makes (no NCCL: no NCCL targets; no MPI: no mpi plugin).
MESHRUN_BUILD_DIR="$build_dir" scripts/build.sh "${configure[@]}" --target=meshrun_cuda_smoke \
  >"$build_dir.log" 2>&1 || {
  echo "configure or build failed (last lines of $build_dir.log):"
  tail -30 "$build_dir.log"
  exit 1
}
known="$(ninja -C "$build_dir" -t targets all 2>/dev/null | cut -d: -f1)"
targets=()
for target in "${gpu_targets[@]}"; do
  if grep -qx "$target" <<<"$known"; then targets+=("$target"); else echo "not built here: $target"; fi
done
ninja -C "$build_dir" "${targets[@]}" >>"$build_dir.log" 2>&1 || {
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
if [ -x "$build_dir/bin/meshrun" ]; then
  timeout 120 "$build_dir/bin/meshrun" bench peak --device cuda ||
    echo "benchmark failed or skipped ($?)"
  timeout 120 "$build_dir/bin/meshrun" bench peak --device cuda --json || true
else
  echo "not built here"
fi
exit $status
