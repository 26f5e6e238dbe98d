#!/usr/bin/env bash
# The project's test command (README; .ci/run calls exactly this):
#
#   bash scripts/run_tests.sh [pytest args]
#
# Sets up .venv with pinned dependencies, then runs ruff and the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
python -m pytest "$@"
