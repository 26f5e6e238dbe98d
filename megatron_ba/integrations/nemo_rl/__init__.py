"""NeMo-RL integration: `BalancedPGLossFn` (its LossFunction protocol) and a GRPO entry script.

    from megatron_ba.integrations.nemo_rl import BalancedPGLossFn
    loss_fn = BalancedPGLossFn({"ba_rule": "balanced", "ratio_clip_min": 0.2,
                                "ratio_clip_max": 0.28}, group_size=8)
    loss_fn.attach_plan(train_data)            # the global batch, before policy.train
    policy.train(train_data, loss_fn)

`python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced --config ...` does the swap inside
NeMo-RL's own GRPO script; `megatron-ba train RECIPE backend=nemo_rl` writes its arguments from a
recipe (megatron_ba/integrations/engines/nemo_rl.py). This package imports without NeMo-RL (and
without megatron-core); BalancedPGLossFn needs NeMo-RL when it is made. Tested against NeMo-RL
v0.7.0's own code in tests/nemorl/ (scripts/run_nemorl_tests.sh).
"""

from megatron_ba.integrations.nemo_rl.pg_loss import BalancedPGLossFn

__all__ = ["BalancedPGLossFn"]
