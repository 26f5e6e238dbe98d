#!/usr/bin/env bash
# The project's main job (README): sets up .venv with pinned dependencies, then runs a real GRPO
# training run with Balanced Aggregation on this CPU machine (recipes/tiny-cpu.yaml): megatron-core
# policy, vLLM rollouts, verifiable rewards. Measured on 2 cores: 3 min 49 s from a fresh clone,
# set-up included (docs/performance.md).
#
#   bash scripts/run_main.sh [key=value overrides ...]
#
# The run folder (printed at the end) holds metrics.jsonl, summary.json, plots/ and checkpoints/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. "${MEGATRON_BA_VENV:-.venv}/bin/activate"
run_dir="runs/tiny-cpu-$(date +%Y%m%d-%H%M%S)"
exec megatron-ba train recipes/tiny-cpu.yaml "$@" --run-dir "$run_dir"
