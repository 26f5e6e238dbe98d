#!/usr/bin/env bash
# Create (or reuse) .venv-nemorl: NeMo-RL v0.7.0 from its source on Python 3.12, for the NeMo-RL
# integration's tests (scripts/run_nemorl_tests.sh).
#
#   bash scripts/setup_nemorl_env.sh                    # the source archive beside the checkout
#   NEMO_RL_SRC=~/src/RL bash scripts/setup_nemorl_env.sh   # a NeMo-RL checkout of your own
#
# The source: NEMO_RL_SRC (a checkout, used in place) or else NeMo-RL's v0.7.0 source archive
# (NEMO_RL_TARBALL, default ../shared/third_party/nemo-rl-0.7.0-src.tar.gz beside the checkout),
# unpacked once into ~/.cache/megatron-ba/. The package index serves no NeMo-RL (only a placeholder),
# and its own dependency list does not resolve here (Python >= 3.13.13, a TransferQueue from git,
# CUDA pins that contradict torch's), so: torch and the packages of requirements/nemorl.txt at the
# versions of the source's own uv.lock (scripts/uv_lock_pins.py), nemo-automodel without its
# dependencies, then NeMo-RL itself editable without its dependencies (its pyproject lists only the
# top-level package `nemo_rl`, so a regular install would lack nemo_rl.algorithms).
# ~4-5 min and ~6 GB the first time (torch 2.11's CUDA build, which runs on CPU); cached outside
# the checkout like the other environments (scripts/env_lib.sh); MEGATRON_BA_NEMORL_VENV=DIR
# builds in DIR instead. Prints `[setup-nemorl] ok: ...` and the source's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env_lib.sh
PY=$(find_python 3.12)

nemo_rl_source() {
  if [ -n "${NEMO_RL_SRC:-}" ]; then
    [ -f "$NEMO_RL_SRC/nemo_rl/algorithms/grpo.py" ] || {
      echo "NEMO_RL_SRC: $NEMO_RL_SRC is not a NeMo-RL checkout (no nemo_rl/algorithms/grpo.py)" >&2
      return 1
    }
    (cd "$NEMO_RL_SRC" && pwd)
    return 0
  fi
  local tarball=${NEMO_RL_TARBALL:-} cand
  if [ -z "$tarball" ]; then
    for cand in ../shared/third_party/nemo-rl-0.7.0-src.tar.gz \
      /work/shared/third_party/nemo-rl-0.7.0-src.tar.gz; do
      [ -f "$cand" ] && { tarball=$cand; break; }
    done
  fi
  if [ -z "$tarball" ] || [ ! -f "$tarball" ]; then
    echo "NEMO_RL_TARBALL: NeMo-RL's source archive not found (looked for" \
      "../shared/third_party/nemo-rl-0.7.0-src.tar.gz); set NEMO_RL_TARBALL to it or NEMO_RL_SRC" \
      "to a NeMo-RL checkout" >&2
    return 1
  fi
  local sum dir
  sum=$(sha256sum "$tarball" | cut -c1-16)
  dir="${XDG_CACHE_HOME:-$HOME/.cache}/megatron-ba/nemo-rl-src-$sum"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    tar xzf "$tarball" -C "$dir" --strip-components=1
    touch "$dir/.complete"
  fi
  echo "$dir"
}

env_lock nemorl
SRC=$(nemo_rl_source)
inputs=(requirements/nemorl.txt scripts/setup_nemorl_env.sh scripts/uv_lock_pins.py
  "$SRC/uv.lock")
if [ -n "${MEGATRON_BA_NEMORL_VENV:-}" ]; then
  VENV=$MEGATRON_BA_NEMORL_VENV
  case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
else
  # The source's path is an input too: NeMo-RL is installed editable from it.
  VENV=$(cached_env_path nemorl "$PY" "${inputs[@]}" <(echo "$SRC"))
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() {
  "$VENV/bin/pip" install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
if env_is_complete "$VENV"; then
  echo "[setup-nemorl] $VENV is up to date"
else
  echo "[setup-nemorl] building $VENV with $("$PY" --version) from $SRC"
  env_start "$VENV" "$PY"
  mapfile -t pinned < <("$PY" scripts/uv_lock_pins.py "$SRC/uv.lock" requirements/nemorl.txt)
  mapfile -t no_deps < <("$PY" scripts/uv_lock_pins.py "$SRC/uv.lock" requirements/nemorl.txt \
    --no-deps)
  # torch first and pinned, as everywhere: a range would let pip pick another build.
  echo "[setup-nemorl] installing ${pinned[0]} (its CUDA build; it runs on CPU)"
  pipq "${pinned[0]}"
  echo "[setup-nemorl] installing the pinned packages NeMo-RL imports"
  # pip then lists NeMo-RL's and nemo-automodel's unmet declared dependencies: expected, filtered.
  pipq "${pinned[@]:1}" 2>&1 | { grep -v -e "^nemo-rl [0-9.]* requires" \
    -e "^nemo-automodel [0-9.]* requires" -e "dependency resolver does not currently" || true; }
  pipq --no-deps "${no_deps[@]}"
  pipq --no-deps --ignore-requires-python -e "$SRC"
  env_finish "$VENV"
fi
# This checkout's own .venv-nemorl over the cached dependencies (scripts/env_lib.sh): another clone
# sharing the cache can never be the code it imports.
if [ -n "${MEGATRON_BA_NEMORL_VENV:-}" ]; then
  # The project itself without dependencies (its core needs torch alone).
  pipq --no-deps -e .
else
  checkout_env "$VENV" .venv-nemorl "$PY"
  VENV=$PWD/.venv-nemorl
fi
(cd /tmp && "$VENV/bin/python" - "$SRC" <<'PY'
import sys
import nemo_rl, torch, transformers, megatron_ba
import nemo_rl.algorithms.grpo, nemo_rl.algorithms.loss, nemo_rl.models.automodel.train  # noqa
assert sys.version_info[:2] == (3, 12), sys.version
assert nemo_rl.__file__.startswith(sys.argv[1]), (nemo_rl.__file__, sys.argv[1])
print(f"[setup-nemorl] ok: NeMo-RL {nemo_rl.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
print(sys.argv[1])
PY
)
