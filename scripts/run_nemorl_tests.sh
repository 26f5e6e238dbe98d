#!/usr/bin/env bash
# The NeMo-RL integration against NeMo-RL v0.7.0's own code, in .venv-nemorl:
#
#   bash scripts/run_nemorl_tests.sh [pytest args]       # NEMO_RL_SRC=DIR: your own checkout
#
# Sets up .venv-nemorl (scripts/setup_nemorl_env.sh, idempotent), then runs
#   1. NeMo-RL's own loss tests (test_loss_functions.py of its unit tests) twice, without and
#      with the integration imported (`-p megatron_ba.integrations.nemo_rl.run_grpo_balanced`):
#      the same counts of passed / skipped / failed tests both times (on CPU NeMo-RL skips its GPU
#      tests);
#   2. tests/nemorl/ (pytest args go here): BalancedPGLossFn against ClippedPGLossFn and float64
#      references, through NeMo-RL's training step on 2 DP ranks (plain, dynamic batching,
#      packing), one real grpo_train step, the MasterConfig of the stock yaml, the documented
#      command, the entry's preflight on CPU (its line and exit status 69) and a real
#      backend=nemo_rl Slurm job of it (SLURM_CONF's Slurm, else one scripts/slurm_up.sh starts);
#   3. meanwhile, the light install in .venv-nemorl (tests/light_install.py: this checkout's wheel
#      alone, the nemo_rl probe of tests/light_probe.py).
# CI runs it after the main suite. In .venv the tests in tests/nemorl/ skip.
set -euo pipefail
cd "$(dirname "$0")/.."
# Its own Ray head (whose end is `ray stop --force`: every Ray process of the user) and its Slurm
# job use machine-wide state, so the whole script runs under the machine's cluster lock
# (tests/cluster_lock.py): a suite beside it that submits Slurm jobs or starts Ray waits its turn.
if [ "${MBA_CLUSTER_LOCK_HELD:-}" != 1 ]; then
  exec python3 tests/cluster_lock.py bash "$PWD/scripts/run_nemorl_tests.sh" "$@"
fi
setup_log=$(mktemp)
bash scripts/setup_nemorl_env.sh | tee "$setup_log"
src=$(tail -n 1 "$setup_log")
rm -f "$setup_log"
VENV=${MEGATRON_BA_NEMORL_VENV:-.venv-nemorl}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The light install in NeMo-RL's environment (the wheel alone, no megatron-core there), in the
# background: mostly NeMo-RL's imports.
main_venv=${MEGATRON_BA_VENV:-.venv}
[ -x "$main_venv/bin/python" ] || bash scripts/setup_env.sh
light_log=$(mktemp)
"$main_venv/bin/python" tests/light_install.py --venv "$VENV" --hide megatron vllm -- nemo_rl \
  >"$light_log" 2>&1 &
light_pid=$!

# One local Ray for every part below: NeMo-RL's init_ray joins a running cluster that carries its
# tag (nrl_tag_ALL without CUDA_VISIBLE_DEVICES) instead of starting one per process, and the
# dashboard init_ray would start (its metrics module times out on a loaded machine) stays off.
ray_log=$(mktemp)
"$VENV/bin/ray" start --head --disable-usage-stats --include-dashboard=false \
  --num-cpus "$(nproc)" --resources '{"nrl_tag_ALL": 1}' >"$ray_log" 2>&1 \
  || { cat "$ray_log" >&2; exit 1; }
trap '"$VENV/bin/ray" stop --force >/dev/null 2>&1 || true; rm -f "$ray_log"' EXIT

# The summary counts of one run of NeMo-RL's loss tests, e.g. "22 passed, 44 skipped".
own_tests() {
  local out
  out=$(cd "$src/tests/unit/algorithms" && "$VENV/bin/python" -m pytest test_loss_functions.py \
    -p no:cacheprovider -q "$@" 2>&1) || { echo "$out" | tail -n 30 >&2; return 1; }
  echo "$out" | tail -n 1 | grep -oE '[0-9]+ (passed|skipped|failed|xfailed|xpassed|error)s?' \
    | paste -sd' ' -
}
echo "[nemorl-tests] NeMo-RL's own loss tests, without the integration"
without=$(own_tests)
echo "[nemorl-tests] ... and with megatron_ba.integrations.nemo_rl imported"
with=$(own_tests -p megatron_ba.integrations.nemo_rl.run_grpo_balanced)
echo "[nemorl-tests] without: $without; with: $with"
if [ "$without" != "$with" ] || [ -z "$with" ]; then
  echo "[nemorl-tests] importing the integration changed NeMo-RL's own test results" >&2
  exit 1
fi
status=0
"$VENV/bin/python" -m pytest tests/nemorl -p no:cacheprovider "$@" || status=$?
if ! wait "$light_pid"; then
  echo "[nemorl-tests] the light install in $VENV failed:" >&2
  status=1
fi
cat "$light_log" && rm -f "$light_log"
exit $status
