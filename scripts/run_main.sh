#!/usr/bin/env bash
# The project's main job (README): sets up .venv with pinned dependencies, then runs it.
#
#   bash scripts/run_main.sh [extra arguments]
#
# For now: the aggregation demo (`megatron-ba plan`). It becomes the CPU GRPO training run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
exec megatron-ba plan "$@"
