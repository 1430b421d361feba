#!/usr/bin/env bash
# The main job: builds meshrun, then trains the reference example (a tiny
# Llama on the bytes of the GPL) with FSDP2 on 4 ranks into runs/main-job.
# Extra arguments are passed on (e.g. train.steps=200 train.lr=1e-3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec "${MESHRUN_BUILD_DIR:-build}/bin/meshrun" train examples/llama-tiny.toml \
  --nproc-per-node 4 --output runs/main-job "$@"
