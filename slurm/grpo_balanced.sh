#!/usr/bin/env bash
# GRPO with Balanced Aggregation on a Slurm cluster (slurm/README.md has every setting).
#
#   sbatch [sbatch options] slurm/grpo_balanced.sh RECIPE [key=value ...]
#   sbatch --nodes=4 --gpus-per-node=8 --time=24:00:00 slurm/grpo_balanced.sh recipes/X.yaml
#   sbatch --ntasks-per-node=8 --gpus-per-node=8 slurm/grpo_balanced.sh RECIPE backend=nemo_aligner
#   sbatch --nodes=4 --gpus-per-node=8 slurm/grpo_balanced.sh RECIPE backend=verl      # or nemo_rl
#   DRY_RUN=1 SLURM_JOB_NODELIST='gpu[01-04]' GPUS_PER_NODE=8 bash slurm/grpo_balanced.sh RECIPE
#
# `backend: local`: one torchrun --nnodes N per node (srun). `backend: nemo_aligner`: one srun
# task per process (hence --ntasks-per-node), each `megatron-ba train` writing the recipe's
# prompts and running NeMo-Aligner's entry with the recipe as overrides. `backend: verl` /
# `nemo_rl`: a Ray cluster over the allocation (head on the first node, a worker on each other
# node), then `megatron-ba train` on the head, which becomes verl's / NeMo-RL's entry point; on
# preemption the engine is ended and resumes from its own latest checkpoint after the requeue.
# Rendezvous on the first node of SLURM_JOB_NODELIST. Preemption / time limit: Slurm sends SIGUSR1 to this shell 300 s
# before the end (--signal below), training checkpoints at the next step boundary, and this job
# requeues itself; the requeued job resumes from that checkpoint. --dependency=singleton keeps one
# job per job name, which this script sets to the run folder's name.
#SBATCH --job-name=megatron-ba
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --dependency=singleton
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
# Slurm's warning (USR1) can come before training starts: remembered, acted on at launch (mba_run).
MBA_EARLY_USR1=0
trap 'MBA_EARLY_USR1=1' USR1

# Under sbatch this file is a spooled copy: find the checkout from the submitted script's path
# (the first record: an array's last task shares the array's id, which lists every task).
if [[ -z ${MBA_HOME:-} && -n ${SLURM_JOB_ID:-} && ${DRY_RUN:-0} != 1 ]]; then
    submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null |
        sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1) || true
    [[ -f $submitted ]] && MBA_HOME=$(cd "$(dirname "$submitted")/.." && pwd)
fi
MBA_HOME=${MBA_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=slurm/lib.sh
source "$MBA_HOME/slurm/lib.sh"

if [[ -n ${MBA_STUDY:-} ]]; then # a task of a study's job array: its element's run
    mba_study_element "$@"
    set -- "${MBA_ARGS[@]}"
fi
mba_plan batch "$@"
if [[ ${DRY_RUN:-0} == 1 ]]; then
    rm -f "$MBA_RESOLVED"
    mba_describe
    exit 0
fi
[[ -n ${SLURM_JOB_ID:-} ]] || mba_die "not inside a Slurm job: submit with sbatch (or DRY_RUN=1 to preview)"
mba_check_backend

# Singleton per run: later jobs for this run folder (sbatch -J NAME --dependency=singleton) wait.
if [[ ${SLURM_JOB_NAME:-} != "$MBA_JOB_NAME" ]]; then
    scontrol update JobId="$SLURM_JOB_ID" JobName="$MBA_JOB_NAME" ||
        mba_say "could not rename job $SLURM_JOB_ID to $MBA_JOB_NAME (singleton keys on the name)"
fi
mba_say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${MBA_HOSTS[*]}; resume=$MBA_RESUME"
mba_run
if ((MBA_PREEMPTED)) && mba_is_ray; then
    mba_say "preempted: $RECIPE_BACKEND ended; requeueing job $SLURM_JOB_ID (it resumes from its latest checkpoint in $MBA_RUN_DIR/checkpoints)"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
elif ((MBA_PREEMPTED)); then
    mba_say "preempted: checkpoint saved in $MBA_RUN_DIR; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if mba_is_ray && ((MBA_RC == 69)); then # NEEDS_GPU (megatron_ba/integrations/exit_status.py)
    mba_say "the $RECIPE_BACKEND entry's preflight passed (config, data, reward) and training needs CUDA GPUs these nodes lack: its line is in $MBA_LOG_DIR/entry.log"
fi
mba_say "finished with exit status $MBA_RC; run folder $MBA_RUN_DIR"
exit "$MBA_RC"
