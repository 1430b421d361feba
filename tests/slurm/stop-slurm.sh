#!/usr/bin/env bash
# Stops the private Slurm that start-slurm.sh started in DIR: cancels its
# jobs, then ends slurmd, slurmctld and munged by the pids in their pid files
# (SIGTERM, SIGKILL after 10 s). Nothing else is touched; safe to run twice.
#
#   stop-slurm.sh DIR
set -euo pipefail

[ $# -eq 1 ] || { echo "usage: $0 STATE_DIR" >&2; exit 2; }
dir=$1
[ -d "$dir" ] || exit 0

# The pid in FILE when that process is alive and its name starts with NAME.
live_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2"* ]] && echo "$pid"
}

# Cancel running jobs first so that their slurmstepd and tasks go too.
if [ -f "$dir/slurm.conf" ] && live_pid "$dir/slurmctld.pid" slurmctld >/dev/null; then
  export SLURM_CONF="$dir/slurm.conf"
  timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
  for _ in $(seq 20); do
    [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.5
  done
fi

pids=()
for entry in slurmd.pid:slurmd slurmctld.pid:slurmctld munge/munged.pid:munged; do
  if pid=$(live_pid "$dir/${entry%%:*}" "${entry##*:}"); then
    kill -TERM "$pid" 2>/dev/null || true
    pids+=("$pid")
  fi
done
for pid in "${pids[@]}"; do
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  ! kill -0 "$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
done
