#!/usr/bin/env bash
# The main job: builds meshrun, then runs it on the reference example. Until
# the trainer lands this shows the plan a 4-rank run would use; extra
# arguments are passed on (e.g. --json, distributed.tp_size=2).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec "${MESHRUN_BUILD_DIR:-build}/bin/meshrun" plan examples/llama-tiny.toml --world-size 4 "$@"
