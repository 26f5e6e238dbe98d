#!/usr/bin/env bash
# A real Slurm on this machine, for the tests and CI (tests/test_slurm.py, .ci/run): two nodes on
# this one host by default, each a slurmd of its own, so that multi-node jobs (a Ray head and a
# worker) run for real.
#
#   eval "$(bash scripts/slurm_up.sh)"     # starts munge + slurmctld + slurmds; prints `export SLURM_CONF=...`
#   sbatch slurm/grpo_balanced.sh recipes/tiny-cpu.yaml grpo.steps=2
#   bash scripts/slurm_down.sh             # stops what slurm_up.sh started, by its PID files
#
# Settings (environment): SLURM_CI_DIR (config, state, logs, PID files; default
# /tmp/megatron-ba-slurm), SLURM_CI_CTLD_PORT / SLURM_CI_D_PORT (6817 / 6818),
# SLURM_CI_NO_INSTALL=1 (fail instead of `apt-get install`ing the Debian packages), SLURM_CI_NODES
# (1 or 2, default 2).
# The nodes: the first is named after this host (hostname -s); the second is `localhost` (its
# slurmd listens on SLURM_CI_D_PORT + 1). Both names resolve to this host, so whichever node is
# first in a job's node list, the launchers' rendezvous address (that node's name) resolves. Both
# have all of this host's CPUs and memory (the second overbooks them), and the first has the lower
# Weight: a one-node job runs on it while it has room.
# Needs root (the daemons run as root, no systemd). Idempotent: when its daemons already answer it
# only prints the export line. Stdout carries nothing but that line; progress goes to stderr.
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/megatron-ba-slurm}
CTLD_PORT=${SLURM_CI_CTLD_PORT:-6817}
D_PORT=${SLURM_CI_D_PORT:-6818}
NODES=${SLURM_CI_NODES:-2}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
[[ $NODES == 1 || $NODES == 2 ]] || { echo "slurm_up: SLURM_CI_NODES=$NODES: expected 1 or 2" >&2; exit 1; }
NAMES=("$NODE")
[[ $NODES == 2 ]] && NAMES+=(localhost)

say() { echo "slurm_up: $*" >&2; }
die() { say "$*"; exit 1; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    local missing=()
    for bin in slurmctld slurmd sbatch munged; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ ${SLURM_CI_NO_INSTALL:-0} == 1 ]] && die "missing ${missing[*]} and SLURM_CI_NO_INSTALL=1"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    [[ $(id -u) == 0 ]] || die "missing ${missing[*]}; installing them needs root"
    say "installing slurmctld slurmd slurm-client munge (apt-get)"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >&2
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0 # a munged already answers (this script's or the system's): leave it alone
    fi
    [[ -f /etc/munge/munge.key ]] || mungekey --create >&2
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    runuser -u munge -- /usr/sbin/munged
    # Ours to stop: slurm_down.sh stops munged only when this file names it.
    cp /run/munge/munged.pid "$DIR/run/munged.pid"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not answer (munge -n | unmunge)"
}

write_conf() {
    local cpus mem_mib
    cpus=$(nproc)
    mem_mib=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)
    cat >"$CONF" <<CONF
# Written by scripts/slurm_up.sh: ${#NAMES[@]} node(s) on loopback for tests and CI.
ClusterName=megatron-ba-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/d/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
SchedulerType=sched/backfill
ReturnToService=2
# An impossible request fails at once instead of queueing forever.
EnforcePartLimits=ALL
SlurmdTimeout=30
KillWait=5
# A requeued job becomes eligible cred_expire + 1 s after it ended, once the credentials of its
# last run have expired (a credential from that same second would be refused as revoked). 120 s
# by default; 15 s here, ample for a step launch on one node, so a requeue test waits for
# Slurm's own release instead of forcing an early one.
AuthInfo=cred_expire=15
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib Weight=1 State=UNKNOWN
CONF
    if ((NODES == 2)); then
        echo "NodeName=localhost NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$((D_PORT + 1)) CPUs=$cpus RealMemory=$mem_mib Weight=2 State=UNKNOWN" >>"$CONF"
    fi
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

wait_registered() { # NODE
    # After `slurmd` forks, sinfo can say idle before slurmd registered (saved state): wait for
    # the registration line of this slurmd in its own log, then for the node to be idle.
    local log=$DIR/log/slurmd-$1.log
    for _ in $(seq 150); do
        if grep -q "slurmd started" "$log" 2>/dev/null &&
            [[ $(SLURM_CONF=$CONF sinfo -h -N -n "$1" -o %T 2>/dev/null) == idle ]]; then
            return 0
        fi
        sleep 0.2
    done
    die "node $1 did not register as idle in 30 s; see $DIR/log/"
}

main() {
    local name
    # A running cluster is used as it is, whatever its number of nodes (tests adapt to it).
    if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/slurmd-$NODE.pid" &&
        SLURM_CONF=$CONF sinfo -h >/dev/null 2>&1; then
        say "already running ($DIR): node(s) $(SLURM_CONF=$CONF sinfo -h -N -o %N | sort -u | xargs)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    [[ $(id -u) == 0 ]] || die "needs root (slurmctld and slurmd run as root here)"
    install_packages
    # A fresh state every time: no jobs or node states left from an earlier cluster.
    bash "$(dirname "$0")/slurm_down.sh" >/dev/null 2>&1 || true
    rm -rf "$DIR/state" "$DIR/log"
    mkdir -p "$DIR/state/ctld" "$DIR/run" "$DIR/log"
    for name in "${NAMES[@]}"; do mkdir -p "$DIR/state/d/$name"; done
    start_munge
    write_conf
    SLURM_CONF=$CONF slurmctld -f "$CONF"
    for name in "${NAMES[@]}"; do SLURM_CONF=$CONF slurmd -f "$CONF" -N "$name"; done
    for name in "${NAMES[@]}"; do wait_registered "$name"; done
    say "up: node(s) ${NAMES[*]}, partition debug, logs in $DIR/log"
    echo "export SLURM_CONF=$CONF"
}

main "$@"
