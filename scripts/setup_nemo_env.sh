#!/usr/bin/env bash
# Create (or refresh) .venv-nemo: a CPU environment with NeMo-Aligner 0.7.0's real classes
# (NeMo 2.1.0, megatron-core 0.10.0, torch 2.13 CPU), for tests/nemo/ and the contract test.
#
#   bash scripts/setup_nemo_env.sh     # idempotent: re-installs only when its inputs changed
#
# It also downloads the pure-Python nemo-aligner 0.7.0 wheel into .nemo-wheels/ (the contract test
# parses it; tests never download). Separate from .venv: NeMo 2.1 needs numpy 1.x, transformers 4.x
# and megatron-core 0.10, which the main environment cannot share.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRON_BA_NEMO_VENV:-.venv-nemo}
WHEELS=${MEGATRON_BA_NEMO_WHEELS:-.nemo-wheels}
PY=${PYTHON:-python3}
ALIGNER=nemo-aligner==0.7.0

stamp_of() {
  cat requirements/torch-cpu.txt requirements/nemo.txt scripts/setup_nemo_env.sh | sha256sum | cut -d' ' -f1
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-nemo] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
want=$(stamp_of)
if [ -f "$VENV/.megatron_ba_stamp" ] && [ "$(cat "$VENV/.megatron_ba_stamp")" = "$want" ] \
  && ls "$WHEELS"/nemo_aligner-0.7.0-*.whl >/dev/null 2>&1; then
  echo "[setup-nemo] $VENV is up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  pip "$@" -q 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
echo "[setup-nemo] downloading the $ALIGNER wheel into $WHEELS/"
mkdir -p "$WHEELS"
pipq download --no-deps --only-binary=:all: -d "$WHEELS" "$ALIGNER"
echo "[setup-nemo] installing torch (pinned CPU build) first: unpinned, it pulls a CUDA build"
pipq install -r requirements/torch-cpu.txt
echo "[setup-nemo] installing NeMo 2.1.0 and megatron-core 0.10.0 (~2 GB the first time)"
pipq install -r requirements/nemo.txt
# --no-deps: nemo-aligner 0.7.0's own requirements name unpinned NeMo/megatron-core.
pipq install --no-deps "$WHEELS"/nemo_aligner-0.7.0-*.whl
# nemo_toolkit and nemo-aligner both install a top-level `tests` package (their own test
# suites); drop it so that it cannot shadow this repository's tests/.
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if grep -qs '^tests/' "$site"/nemo_toolkit-*.dist-info/RECORD "$site"/nemo_aligner-*.dist-info/RECORD; then
  rm -rf "$site/tests"
fi
pipq install --no-deps -e .
python - <<'PY'
import megatron.core, nemo, torch
assert torch.__version__.startswith("2.13."), torch.__version__
assert megatron.core.__version__ == "0.10.0", megatron.core.__version__
assert nemo.__version__ == "2.1.0", nemo.__version__
from importlib.metadata import version
assert version("nemo_aligner") == "0.7.0", version("nemo_aligner")
print(f"[setup-nemo] ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"nemo {nemo.__version__}, nemo-aligner {version('nemo_aligner')}")
PY
echo "$want" > "$VENV/.megatron_ba_stamp"
