#!/usr/bin/env bash
# The single-GPU check (docs/performance.md, "The GPU check"): for a machine with one GPU, Python
# 3.12 with a CUDA build of torch preinstalled (python3; it may itself be a venv) and NO network.
#
#   bash scripts/fetch_gpu_wheels.sh       # once, where pip reaches PyPI: .gpu-wheels/
#   # copy the checkout, .gpu-wheels/ included, to the GPU machine; there, in its root:
#   bash scripts/gpu_check.sh [OUT.json]   # default ./gpu_check.json
#
# Output: OUT.json, every stage's pass/fail, command, seconds and figures (scripts/gpu_check.py
# lists the stages), rewritten as each stage ends. The wheels install into a venv that sees the
# system's torch (--system-site-packages); nothing is downloaded. Ends within 10 minutes: 20 s
# for the venv, 30 s for the install, 495 s for the stages (each with its own budget inside that),
# 10 s of grace to kill them.
#
# Environment: GPU_CHECK_ALLOW_CPU=1 runs the stages on the CPU at tiny sizes (the plumbing,
# e.g. here, without a GPU); GPU_CHECK_NO_VENV=1 uses the current python as it is (no install);
# GPU_CHECK_VENV (default /tmp/gpu-check-venv); GPU_CHECK_WHEELS (default .gpu-wheels);
# PYTHON (default python3); GPU_CHECK_STAGES: the stages after env to run, comma-separated
# (default all).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$(pwd)
out=${1:-./gpu_check.json}
python=${PYTHON:-python3}
venv=${GPU_CHECK_VENV:-/tmp/gpu-check-venv}
wheel_dir=${GPU_CHECK_WHEELS:-.gpu-wheels}
log() { echo "gpu_check.sh: $*" >&2; }

if [ "${GPU_CHECK_NO_VENV:-0}" = 1 ]; then
  py=$python
else
  shopt -s nullglob
  wheels=("$wheel_dir"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    log "no wheels in $wheel_dir/: run scripts/fetch_gpu_wheels.sh where pip reaches PyPI"
    exit 2
  fi
  # --without-pip: the venv runs the system's pip (seen through the system site-packages), which
  # installs into the venv; ensurepip would take 5-25 s for nothing.
  if ! timeout 20 "$python" -m venv --system-site-packages --without-pip "$venv"; then
    log "could not make the venv $venv with $python"
    exit 2
  fi
  py=$venv/bin/python
  # When python3 is itself a venv (e.g. /opt/torch/.venv), a venv made from it sees the BASE
  # interpreter's site-packages, not that venv's, where torch is. A .pth file appends the parent's
  # site-packages after the new venv's own, so torch (and pip) are found and our wheels win.
  parent_site=$("$python" -c 'import site; print("\n".join(site.getsitepackages()))') || exit 2
  venv_site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 2
  printf '%s\n' "$parent_site" >"$venv_site/_gpu_check_parent.pth"
  # --no-deps: the wheels are the whole set (fetch_gpu_wheels.sh); the rest, torch first, is the
  # system's. The env stage records `pip check` so that a missing or clashing one shows.
  if ! timeout 30 "$py" -m pip install -q --no-index --no-deps --no-compile \
    --find-links "$wheel_dir" "${wheels[@]}"; then
    log "pip install from $wheel_dir/ failed (see above)"
    exit 2
  fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log "python: $py; figures: $out"
stages=()
[ -n "${GPU_CHECK_STAGES:-}" ] && stages=(--stages "$GPU_CHECK_STAGES")
cap=495
# the CPU dry run's stage budgets are gpu_check.py's CPU_BUDGET_SCALE (4) times the GPU's
[ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] && cap=$((495 * 4))
timeout --kill-after=10 "$cap" "$py" scripts/gpu_check.py --out "$out" "${stages[@]}"
rc=$?
[ $rc -eq 124 ] && log "the stages ran past $cap s; $out holds those that finished"
exit $rc
