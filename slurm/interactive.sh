#!/usr/bin/env bash
# GRPO on the node you are on (inside `salloc` / `srun --pty bash`, or any machine): torchrun on
# this node only, the same recipe check, environment, run folder and logs as grpo_balanced.sh.
#
#   bash slurm/interactive.sh RECIPE [key=value ...]
#   DRY_RUN=1 GPUS_PER_NODE=8 bash slurm/interactive.sh RECIPE     # print, launch nothing
#
# `kill -USR1 <this shell>` makes training checkpoint at the next step and stop (exit 75); run
# the same command again to resume from that checkpoint.
set -euo pipefail
MBA_HOME=${MBA_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=slurm/lib.sh
source "$MBA_HOME/slurm/lib.sh"

mba_plan interactive "$@"
if [[ ${DRY_RUN:-0} == 1 ]]; then
    rm -f "$MBA_RESOLVED"
    mba_describe
    exit 0
fi
mba_check_backend
mba_run
if ((MBA_PREEMPTED)); then
    mba_say "stopped: checkpoint saved in $MBA_RUN_DIR; the same command resumes it"
    exit 75
fi
exit "$MBA_RC"
