#!/usr/bin/env bash
# Stops what scripts/slurm_up.sh started, by the PIDs in its PID files (never by name).
#   bash scripts/slurm_down.sh          # SLURM_CI_DIR as for slurm_up.sh
# munged is stopped only when slurm_up.sh started it. Killed daemons can linger as zombies for a
# few seconds on this machine: state Z counts as stopped.
set -uo pipefail

DIR=${SLURM_CI_DIR:-/tmp/megatron-ba-slurm}

stopped() {
    local state
    state=$(ps -o stat= -p "$1" 2>/dev/null) || return 0
    [[ $state == Z* ]]
}

stop_pidfile() {
    local file=$1 pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do
            stopped "$pid" && break
            sleep 0.1
        done
        stopped "$pid" || kill -KILL "$pid" 2>/dev/null
        echo "slurm_down: stopped $(basename "$file" .pid) (pid $pid)"
    fi
    rm -f "$file"
}

for f in "$DIR"/run/slurmd-*.pid; do
    [[ -e $f ]] && stop_pidfile "$f"
done
stop_pidfile "$DIR/run/slurmctld.pid"
stop_pidfile "$DIR/run/munged.pid"
exit 0
