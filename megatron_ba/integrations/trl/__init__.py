"""TRL integration: `BalancedGRPOTrainer`, a `trl.GRPOTrainer` aggregated by a megatron-ba plan.

    from megatron_ba.integrations.trl import BalancedGRPOTrainer
    trainer = BalancedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                  train_dataset=..., aggregation="balanced", scope="group")

Needs `trl` (pinned in requirements/cpu.txt; extra `megatron-ba[trl]`).
"""

from megatron_ba.integrations.trl.trainer import BalancedGRPOTrainer

__all__ = ["BalancedGRPOTrainer"]
