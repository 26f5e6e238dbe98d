#!/usr/bin/env bash
# Create (or reuse) .venv-nemo: a CPU environment with NeMo-Aligner 0.7.0's real classes
# (NeMo 2.1.0, megatron-core 0.10.0, torch 2.13 CPU), for tests/nemo/ and the contract test.
#
#   bash scripts/setup_nemo_env.sh     # idempotent: builds only when its inputs changed
#
# It also downloads the pure-Python nemo-aligner 0.7.0 wheel into .nemo-wheels/ (the contract test
# parses it; tests never download). Separate from .venv: NeMo 2.1 needs numpy 1.x, transformers 4.x
# and megatron-core 0.10, which the main environment cannot share. Cached outside the checkout like
# .venv (scripts/env_lib.sh); MEGATRON_BA_NEMO_VENV=DIR builds in DIR instead.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env_lib.sh
WHEELS=${MEGATRON_BA_NEMO_WHEELS:-.nemo-wheels}
PY=$(find_python 3.11)
ALIGNER=nemo-aligner==0.7.0
inputs=(requirements/torch-cpu.txt requirements/nemo.txt scripts/setup_nemo_env.sh)
if [ -n "${MEGATRON_BA_NEMO_VENV:-}" ]; then
  VENV=$MEGATRON_BA_NEMO_VENV
else
  env_lock nemo
  VENV=$(cached_env_path nemo "$PY" "${inputs[@]}")
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  "$VENV/bin/pip" "$@" -q 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
if ! ls "$WHEELS"/nemo_aligner-0.7.0-*.whl >/dev/null 2>&1; then
  echo "[setup-nemo] downloading the $ALIGNER wheel into $WHEELS/"
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$ALIGNER" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
fi
if env_is_complete "$VENV"; then
  echo "[setup-nemo] $VENV is up to date"
else
  echo "[setup-nemo] building $VENV with $("$PY" --version)"
  env_start "$VENV" "$PY"
  echo "[setup-nemo] installing torch (pinned CPU build) first: unpinned, it pulls a CUDA build"
  pipq install -r requirements/torch-cpu.txt
  echo "[setup-nemo] installing NeMo 2.1.0 and megatron-core 0.10.0 (~2 GB the first time)"
  pipq install -r requirements/nemo.txt
  # --no-deps: nemo-aligner 0.7.0's own requirements name unpinned NeMo/megatron-core.
  pipq install --no-deps "$WHEELS"/nemo_aligner-0.7.0-*.whl
  # nemo_toolkit and nemo-aligner both install a top-level `tests` package (their own test
  # suites); drop it so that it cannot shadow this repository's tests/.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if grep -qs '^tests/' "$site"/nemo_toolkit-*.dist-info/RECORD "$site"/nemo_aligner-*.dist-info/RECORD; then
    rm -rf "$site/tests"
  fi
  env_finish "$VENV"
fi
# This checkout's own .venv-nemo over the cached dependencies (scripts/env_lib.sh): another clone
# sharing the cache can never be the code it imports.
if [ -n "${MEGATRON_BA_NEMO_VENV:-}" ]; then
  pipq install --no-deps -e .
else
  checkout_env "$VENV" .venv-nemo "$PY"
  VENV=$PWD/.venv-nemo
fi
"$VENV/bin/python" - <<'PY'
import megatron.core, nemo, torch
assert torch.__version__.startswith("2.13."), torch.__version__
assert megatron.core.__version__ == "0.10.0", megatron.core.__version__
assert nemo.__version__ == "2.1.0", nemo.__version__
from importlib.metadata import version
assert version("nemo_aligner") == "0.7.0", version("nemo_aligner")
print(f"[setup-nemo] ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"nemo {nemo.__version__}, nemo-aligner {version('nemo_aligner')}")
PY
