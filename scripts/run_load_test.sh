#!/usr/bin/env bash
# The tests most exposed to a busy machine, run while two busy processes take both cores:
#
#   bash scripts/run_load_test.sh [ROUNDS]       # default 3, stops at the first failing round
#
# Each round runs, one after another: tests/test_slurm.py and tests/test_testbed_regimes.py
# (.venv), the verl Slurm job test (.venv-verl), the NeMo-Aligner Slurm job test (.venv-nemo) and
# the NeMo-RL Slurm job test (.venv-nemorl), on the Slurm that scripts/slurm_up.sh starts (or
# SLURM_CONF's). Beside them, two processes spin (`python3 -c 'while True: pass'`) for the whole
# run. Each round's wall time, the load average
# and the verdict go to stdout; pytest's own output to LOG_DIR (default a new temporary folder).
# Needs the environments of scripts/run_tests.sh (built by it, or by the set-up scripts).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
log_dir=${LOG_DIR:-$(mktemp -d -t megatron-ba-load.XXXXXX)}
mkdir -p "$log_dir"
for venv in .venv .venv-verl .venv-nemo .venv-nemorl; do
  [ -x "$venv/bin/python" ] || { echo "[load] $venv is missing: bash scripts/run_tests.sh builds it" >&2; exit 2; }
done
if [ -z "${SLURM_CONF:-}" ]; then
  slurm_env=$(bash scripts/slurm_up.sh)
  eval "$slurm_env"
fi
export SLURM_CONF PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

busy=()
for _ in 1 2; do
  python3 -c 'while True: pass' &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
echo "[load] two busy processes: ${busy[*]}; logs in $log_dir"

suite() {  # NAME VENV TEST...: one pytest run in VENV, its output to LOG_DIR/NAME-ROUND.log
  local name=$1 venv=$2
  shift 2
  (
    [ "$name" != nemo ] || export MEGATRON_BA_MAIN_PYTHON="$PWD/.venv/bin/python"
    "$venv/bin/python" -m pytest -p no:cacheprovider -q "$@"
  ) >"$log_dir/$name-$round.log" 2>&1
}

for round in $(seq 1 "$rounds"); do
  start=$SECONDS
  status=0
  suite main .venv tests/test_slurm.py tests/test_testbed_regimes.py || status=1
  suite verl .venv-verl tests/test_verl_slurm.py || status=1
  suite nemo .venv-nemo tests/nemo/test_nemo_slurm.py || status=1
  suite nemorl .venv-nemorl tests/nemorl/test_nemo_rl_slurm.py || status=1
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  summary=$(for f in "$log_dir"/*-"$round".log; do
    printf '%s: %s; ' "$(basename "$f" "-$round.log")" "$(tail -n 1 "$f" | tr -d '=')"
  done)
  echo "[load] round $round: $((SECONDS - start)) s, load average $load: $summary"
  [ $status = 0 ] || { echo "[load] round $round failed (logs in $log_dir)"; exit 1; }
done
echo "[load] $rounds rounds passed"
