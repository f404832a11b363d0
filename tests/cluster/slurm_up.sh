#!/usr/bin/env bash
# A one-node SLURM cluster on this host, for tests and demos: munged, slurmctld and slurmd,
# with every file (key, config, spool, logs, pids, munge socket) under one state directory,
# so /etc is left alone (a host's own cluster is not touched either, but for the ports).
#
#   tests/cluster/slurm_up.sh [STATE_DIR]     start (or find running) and wait for the node
#   tests/cluster/slurm_up.sh --down [STATE_DIR]    stop what it started
#
# STATE_DIR defaults to $SHARDLAB_SLURM_DIR, else /tmp/shardlab-slurm. Idempotent: a cluster
# already up in STATE_DIR is reused. The last line printed is the one clients need:
#   export SLURM_CONF=STATE_DIR/slurm.conf
# Needs Debian's `slurm-wlm` and `munge` (apt-get install -y slurm-wlm munge) and root:
# slurmd starts each task as the submitting user. Ports: $SHARDLAB_SLURM_PORT (slurmctld,
# default 6817) and the next one (slurmd).
set -euo pipefail

down=0
if [ "${1:-}" = "--down" ]; then down=1; shift; fi
state=$(realpath -m "${1:-${SHARDLAB_SLURM_DIR:-/tmp/shardlab-slurm}}")
conf=$state/slurm.conf
socket=$state/munge/munge.socket.2

stop() {  # the pid in file $1, if it still runs: TERM, then KILL after 5 s
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

if [ $down = 1 ]; then
  # Jobs first (their steps would outlive slurmd otherwise), then the daemons.
  SLURM_CONF=$conf timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  stop "$state/slurmd.pid"; stop "$state/slurmctld.pid"; stop "$state/munge/munged.pid"
  echo "stopped the SLURM cluster in $state"
  exit 0
fi

for tool in munged slurmctld slurmd sinfo; do
  command -v $tool >/dev/null ||
    { echo "error: $tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done
running() { kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
mkdir -p "$state/munge" "$state/ctld" "$state/spool"
chmod 0700 "$state/munge"

# munge: its own key and socket (slurm.conf points AuthInfo there).
if ! running "$state/munge/munged.pid"; then
  if [ ! -s "$state/munge/munge.key" ]; then
    dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$state/munge/munge.key"
  fi
  munged --force --socket="$socket" --key-file="$state/munge/munge.key" \
    --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
    --seed-file="$state/munge/munged.seed"
fi

host=$(hostname -s)
# Tasks find their coordinator by the node's name (the first of SLURM_STEP_NODELIST).
if ! getent hosts "$host" >/dev/null; then
  echo "error: this host's name '$host' does not resolve: add '127.0.0.1 $host' to /etc/hosts" >&2
  exit 1
fi
user=$(id -un)
port=${SHARDLAB_SLURM_PORT:-6817}
# At least 4 CPUs whatever the host has (config_overrides: slurmd takes the configured
# values), so a 2-task job with --cpus-per-task=1 or 2 fits a small CI machine.
cpus=$(( $(nproc) > 4 ? $(nproc) : 4 ))
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))
cat > "$conf.new" <<EOF
# Written by tests/cluster/slurm_up.sh: one node, for tests.
ClusterName=shardlab
SlurmctldHost=$host(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
# cred_expire: how long a requeued job waits before it starts again (default 120 s).
AuthInfo=socket=$socket,cred_expire=10
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Schedule every second: a requeued job starts once eligible, not at the next minute.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
# KillWait: after SIGTERM, the tasks have this long to save before SIGKILL.
KillWait=120
InactiveLimit=0
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$conf.new" "$conf"; then  # a changed config needs fresh daemons
  stop "$state/slurmd.pid"; stop "$state/slurmctld.pid"
  mv "$conf.new" "$conf"
else
  rm "$conf.new"
fi
export SLURM_CONF=$conf
# -c: no saved jobs or node state from an earlier cluster in this directory.
running "$state/slurmctld.pid" || slurmctld -c -f "$conf"
running "$state/slurmd.pid" || slurmd -f "$conf"

for _ in $(seq 120); do
  if sinfo --noheader --nodes="$host" --format=%T 2>/dev/null | grep -qx idle; then
    echo "SLURM cluster up: node $host, state in $state; stop it with $0 --down $state"
    echo "export SLURM_CONF=$conf"
    exit 0
  fi
  sleep 0.5
done
echo "error: node $host did not become idle within 60 s; sinfo says:" >&2
sinfo --noheader --nodes="$host" --format='%T %E' >&2 || true
tail -n 20 "$state/slurmctld.log" "$state/slurmd.log" >&2 || true
exit 1
