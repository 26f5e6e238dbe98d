"""train_grpo with NeMo-Aligner 0.7.0's per-micro-batch mean in place of the BA plan: the
negative control of tests/nemo/test_nemo_train_grpo.py.

    python tests/nemo/per_microbatch_mean_train_grpo.py [train_grpo's Hydra overrides]

Everything is train_grpo's but the plan's weights: each sequence weighs 1 / (M x DP x T_b),
T_b the response tokens of its micro-batch (NeMo-Aligner's `masked_mean` per micro-batch,
averaged over the M micro-batches and the DP ranks). That objective depends on how the batch is
split, which is what the comparison of micro-batch sizes must see.
"""

from __future__ import annotations

import sys

import torch


def _per_microbatch_mean(build_plan):
    def build(self, batch):
        from megatron.core import parallel_state as mcore_ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        from megatron_ba.loss import LossPlan

        plan, diag, reducer = build_plan(self, batch)
        tokens = batch["mask"].sum(dim=1).to(torch.float64)
        mbs, m = int(self.cfg.micro_batch_size), get_num_microbatches()
        dp = mcore_ps.get_data_parallel_world_size()
        per_mb = torch.stack([chunk.sum() for chunk in tokens.split(mbs)]).repeat_interleave(mbs)
        w = 1.0 / (m * dp * per_mb[: tokens.numel()].clamp(min=1.0))
        return LossPlan(w, w, plan.advantages), diag, reducer

    return build


if __name__ == "__main__":
    from megatron_ba.integrations.nemo_aligner import cpu_shims, train_grpo

    if not torch.cuda.is_available():
        cpu_shims.install()
    from megatron_ba.integrations.nemo_aligner.actor import MegatronGPTGRPOActorModel

    MegatronGPTGRPOActorModel.build_plan = _per_microbatch_mean(
        MegatronGPTGRPOActorModel.build_plan
    )
    sys.argv[0] = train_grpo.__file__  # Hydra finds conf/ beside the entry point
    train_grpo.main()
