#!/usr/bin/env bash
# GRPO with Balanced Aggregation through NeMo-Aligner's own loop, on this CPU, in a few minutes:
#
#   bash scripts/nemo_demo.sh RUN_DIR [key=value ...]     # overrides of recipes/tiny-cpu.yaml
#   bash scripts/nemo_demo.sh runs/nemo-demo grpo.steps=20
#
# Sets up .venv-nemo if needed (scripts/setup_nemo_env.sh), makes the tiny NeMo model once
# (`megatron-ba nemo-tiny-model`: the local backend's warm start of recipes/tiny-cpu.yaml saved as
# a .nemo; cached in RUN_DIR/../nemo-tiny-model, or NEMO_MODEL_DIR), then trains the recipe on
# it with `megatron-ba train ... backend=nemo_aligner` for 10 steps: the recipe's prompts are
# written to RUN_DIR/data/ and NeMo-Aligner's train_grpo runs with the recipe as its overrides
# (on the CPU: one process, fp32, torch's AdamW). RUN_DIR gets NeMo's logs (TensorBoard events,
# checkpoints, the final .nemo) and metrics.jsonl (one line per step, the local backend's metric
# names). docs/nemo-aligner.md has a measured run.
set -euo pipefail
[[ $# -ge 1 && $1 != -* ]] || { echo "usage: bash scripts/nemo_demo.sh RUN_DIR [key=value ...]" >&2; exit 2; }
RUN_DIR=$(mkdir -p "$1" && cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
bash scripts/setup_nemo_env.sh
PY=${MEGATRON_BA_NEMO_VENV:-.venv-nemo}/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
MODEL=${NEMO_MODEL_DIR:-$(dirname "$RUN_DIR")/nemo-tiny-model}
"$PY" -m megatron_ba.cli nemo-tiny-model "$MODEL"
exec "$PY" -m megatron_ba.cli train recipes/tiny-cpu.yaml backend=nemo_aligner \
    model.pretrained="$MODEL/model.nemo" warmstart.enabled=false tokenizer.kind=hf \
    grpo.steps=10 eval.every=5 checkpoint.every=5 "$@" --run-dir "$RUN_DIR" --accelerator cpu
