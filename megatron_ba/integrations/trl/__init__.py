"""TRL integration: `BalancedGRPOTrainer`, a `trl.GRPOTrainer` aggregated by a megatron-ba plan,
and `BalancedAsyncGRPOTrainer`, TRL's experimental AsyncGRPOTrainer with the split-step plan.

    from megatron_ba.integrations.trl import BalancedGRPOTrainer
    trainer = BalancedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                  train_dataset=..., aggregation="balanced", scope="group")

Needs `trl` (pinned in requirements/cpu.txt; extra `megatron-ba[trl]`).
"""

from megatron_ba.integrations.trl.trainer import BalancedGRPOTrainer

__all__ = ["BalancedAsyncGRPOTrainer", "BalancedGRPOTrainer"]


def __getattr__(name: str):
    # Imported on first use: trl.experimental.async_grpo is experimental and slow to import.
    if name == "BalancedAsyncGRPOTrainer":
        from megatron_ba.integrations.trl.async_trainer import BalancedAsyncGRPOTrainer

        return BalancedAsyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
