#!/usr/bin/env bash
# The NeMo-Aligner integration's tests (tests/nemo/) in their own environment:
#
#   bash scripts/run_nemo_tests.sh [pytest args]
#
# Sets up .venv-nemo (scripts/setup_nemo_env.sh: NeMo 2.1.0, megatron-core 0.10.0, nemo-aligner
# 0.7.0, torch 2.13 CPU; ~4 min and ~2.3 GB the first time), then runs tests/nemo/ there. CI runs
# it after the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_nemo_env.sh
# The cross-route test runs the local route in the main environment (.venv, setup_env.sh).
main_venv=${MEGATRON_BA_VENV:-.venv}
[[ $main_venv = /* ]] || main_venv=$PWD/$main_venv
export MEGATRON_BA_MAIN_PYTHON=${MEGATRON_BA_MAIN_PYTHON:-$main_venv/bin/python}
. "${MEGATRON_BA_NEMO_VENV:-.venv-nemo}/bin/activate"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The Slurm job's test last: it may wait for the machine's Slurm while another suite uses it
# (tests/cluster_lock.py), and the other tests need not wait with it.
mapfile -t tests < <(find tests/nemo -name 'test_*.py' ! -name test_nemo_slurm.py | sort)
python -m pytest "${tests[@]}" tests/nemo/test_nemo_slurm.py -p no:cacheprovider "$@"
