"""Balanced Aggregation as a drop-in for other RL stacks: TRL, verl, NeMo-RL and NeMo-Aligner.

Each subpackage is a thin adapter: it turns what its framework hands to a loss hook into
whole-sequence lengths, per-sequence advantages and prompt-group ids, builds the plan with the core
(`megatron_ba.loss.LossPlan.build`, i.e. `plan_statistics` + `weights_from_statistics`) and applies
it with the core's `grpo_loss` / `apply_weights`. No formula is copied here. Each subpackage
imports its framework only when imported itself (docs/integrations.md, docs/nemo-aligner.md).
"""
