#!/usr/bin/env bash
# Starts a private one-node Slurm on this machine for tests: munged, slurmctld
# and slurmd, with config, key, sockets, spool, logs and pid files all under
# the state directory DIR (nothing in /etc/slurm or /etc/munge is used).
#
#   start-slurm.sh DIR      -> prints "SLURM_CONF=DIR/slurm.conf", exit 0
#   stop-slurm.sh DIR       -> stops the daemons again
#
# The node advertises max(nproc, 8) CPUs (SlurmdParameters=config_overrides)
# so `srun -n 4` fits on 2 cores, and MpiDefault=pmix so that Debian's Open
# MPI 4.1 initialises under plain `srun` (it has no PMI-1/PMI-2 support).
# When Slurm cannot run here (not root, packages missing, a daemon fails, not
# ready within 30 s) it prints one line saying why and exits 77 (ctest skip).
# Debian packages: munge slurmctld slurmd slurm-client libpmix-dev (the
# mpi_pmix plugin of slurm-wlm-basic-plugins dlopens pmix2/lib/libpmix.so).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
skip() { echo "slurm unavailable: $*"; [ -z "${dir:-}" ] || "$here/stop-slurm.sh" "$dir" >/dev/null 2>&1 || true; exit 77; }

[ $# -eq 1 ] || { echo "usage: $0 STATE_DIR" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || skip "needs root (slurmd runs as root), uid is $(id -u)"
for tool in munged munge slurmctld slurmd srun sinfo scontrol; do
  command -v "$tool" >/dev/null || skip "$tool not found (apt-get install munge slurmctld slurmd slurm-client libpmix-dev)"
done

mkdir -p "$1"
dir=$(cd "$1" && pwd)
# Unix sockets (munge, slurmstepd, PMIx) live under DIR: keep it short (108-byte limit).
[ ${#dir} -le 60 ] || { dir=""; skip "state dir path longer than 60 characters: $1"; }
"$here/stop-slurm.sh" "$dir" >/dev/null 2>&1 || true   # a previous instance in DIR
rm -rf "$dir/munge" "$dir/ctld" "$dir/spool" "$dir/log" "$dir/slurm.conf"
# munged insists that its socket dir is world-executable and not writable by others.
chmod 755 "$dir"
mkdir -p "$dir/munge" "$dir/ctld" "$dir/spool" "$dir/log"
chmod 755 "$dir/munge"

# Two free TCP ports for slurmctld and slurmd (6817/6818 unless taken).
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=6817
while ! { port_free "$port" && port_free $((port + 1)); }; do
  port=$((port + 2)); [ "$port" -lt 6900 ] || skip "no free port pair in 6817-6899"
done

# munge: a fresh key and a private socket. --force lets it run (with a
# warning) when an ancestor of DIR is group- or world-writable.
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chmod 400 "$dir/munge/munge.key"
munged --force --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
  --seed-file="$dir/munge/munged.seed" </dev/null >>"$dir/log/start.log" 2>&1 ||
  skip "munged failed: $(tail -n1 "$dir/log/start.log")"

host=$(hostname -s)
cpus=$(nproc); [ "$cpus" -ge 8 ] || cpus=8
cat >"$dir/slurm.conf" <<EOF
# Written by tests/slurm/start-slurm.sh: a private one-node cluster.
ClusterName=meshrun-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
PlugStackConfig=$dir/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmix
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
ReturnToService=2
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
: >"$dir/plugstack.conf"
export SLURM_CONF="$dir/slurm.conf"

# Both daemons fork into the background; their stdio must not hold the caller's pipe.
slurmctld -f "$SLURM_CONF" </dev/null >>"$dir/log/start.log" 2>&1 ||
  skip "slurmctld failed: $(tail -n1 "$dir/log/slurmctld.log" 2>/dev/null || tail -n1 "$dir/log/start.log")"
slurmd -f "$SLURM_CONF" -N "$host" </dev/null >>"$dir/log/start.log" 2>&1 ||
  skip "slurmd failed: $(tail -n1 "$dir/log/slurmd.log" 2>/dev/null || tail -n1 "$dir/log/start.log")"

# Ready once the node is idle (bounded: 30 s) and a one-task step runs under
# the pmix plugin (it needs libpmix-dev's libpmix.so).
deadline=$((SECONDS + 30))
until [ "$(sinfo -h -n "$host" -o %t 2>/dev/null)" = idle ]; do
  [ "$SECONDS" -lt "$deadline" ] ||
    skip "node not idle after 30 s: $(sinfo -h -n "$host" -o '%t %E' 2>&1 | head -n1); slurmd.log: $(tail -n1 "$dir/log/slurmd.log" 2>/dev/null)"
  sleep 0.5
done
timeout 20 srun -n1 -t 1 true >"$dir/log/first-step.log" 2>&1 ||
  skip "srun -n1 true failed: $(tail -n1 "$dir/log/first-step.log")"
echo "SLURM_CONF=$SLURM_CONF"
