#!/usr/bin/env bash
# GRPO with Balanced Aggregation through NeMo-Aligner's own loop, on this CPU, in a few minutes:
#
#   bash scripts/nemo_demo.sh RUN_DIR [++key=value ...]     # Hydra overrides of train_grpo
#   bash scripts/nemo_demo.sh runs/nemo-demo trainer.reinforce.max_steps=20
#
# Sets up .venv-nemo if needed (scripts/setup_nemo_env.sh), makes the tiny NeMo model and its
# arithmetic prompts once (`megatron-ba nemo-tiny-model`: the local backend's
# warm start of recipes/tiny-cpu.yaml saved as a .nemo; cached in RUN_DIR/../nemo-tiny-model, or
# NEMO_MODEL_DIR), then runs `python -m megatron_ba.integrations.nemo_aligner.train_grpo` for 10
# steps with the CPU settings below. RUN_DIR gets NeMo's logs (TensorBoard events, checkpoints,
# the final .nemo) and metrics.jsonl (one line per step, the local backend's metric names).
# docs/nemo-aligner.md has a measured run.
set -euo pipefail
[[ $# -ge 1 && $1 != -* ]] || { echo "usage: bash scripts/nemo_demo.sh RUN_DIR [overrides ...]" >&2; exit 2; }
RUN_DIR=$(mkdir -p "$1" && cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
bash scripts/setup_nemo_env.sh
PY=${MEGATRON_BA_NEMO_VENV:-.venv-nemo}/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
MODEL=${NEMO_MODEL_DIR:-$(dirname "$RUN_DIR")/nemo-tiny-model}
"$PY" -m megatron_ba.cli nemo-tiny-model "$MODEL"
# The CPU settings: one process, fp32, torch's AdamW (apex's distributed Adam needs a GPU), the
# local recipe's sizes (32 prompts x 8 responses of up to 64 tokens, one update of 256 per step).
exec "$PY" -m megatron_ba.integrations.nemo_aligner.train_grpo \
    ++pretrained_checkpoint.restore_from_path="$MODEL/model.nemo" \
    ++model.data.data_prefix.train="$MODEL/train.jsonl" \
    ++model.data.data_prefix.validation="$MODEL/val.jsonl" \
    exp_manager.explicit_log_dir="$RUN_DIR" \
    trainer.devices=1 trainer.accelerator=cpu trainer.precision=32 model.megatron_amp_O2=False \
    model.optim.name=adamw '~model.optim.bucket_cap_mb' '~model.optim.overlap_grad_sync' \
    '~model.optim.contiguous_grad_buffer' model.optim.lr=2e-4 model.optim.weight_decay=0.0 \
    model.encoder_seq_length=256 model.micro_batch_size=64 model.global_batch_size=256 \
    model.reinforce.num_rollout_samples=32 model.reinforce.rollout_micro_batch_size=32 \
    model.reinforce.forward_micro_batch_size=64 model.reinforce.offload_adam_states=False \
    model.reinforce.num_val_samples=128 model.reinforce.val_rollout_micro_batch_size=128 \
    model.reinforce.length_params.max_length=64 trainer.reinforce.num_rollouts_per_prompt=8 \
    trainer.reinforce.max_steps=10 trainer.reinforce.val_check_interval=5 \
    trainer.reinforce.save_interval=5 "$@"
