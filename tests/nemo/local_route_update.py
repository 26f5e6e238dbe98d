"""One GRPO loss and gradient through the local backend's megatron-core route, for the cross-route
test.

    .venv/bin/python tests/nemo/local_route_update.py --hf HF_DIR --batch BATCH.pt --out OUT.pt

Runs in the main environment (one gloo process, TP=PP=CP=DP=1, CPU): the policy is built from the
Hugging Face folder by megatron_ba.train.policy.Policy.from_hf (fp32, the local layer spec, DDP),
and the batch goes through megatron_ba.megatron.grpo_step.forward_backward with the
batch's settings and num_microbatches. Saves {"loss", "grads" (full-shape float32, by
megatron-core name), "metrics"}. tests/nemo/nemo_route_update.py computes the same through
NeMo-Aligner in .venv-nemo; tests/nemo/test_nemo_cross_route.py compares them.

BATCH.pt: tokens [B, S]; mask and old_logprobs [B, S-1] position-aligned (entry p scores token
p + 1); advantages [B]; group_ids [B]; num_groups; settings (the GRPO keys, num_microbatches).
GRPOBatch is token-aligned ([B, S], entry t about token t), so both are shifted right by one.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig
from megatron_ba.megatron.grpo_step import (
    GRPOBatch,
    MicroBatchSpec,
    forward_backward,
)
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.full_shape import gather_full_state_dict
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.recipe import load_recipe
from megatron_ba.step_settings import StepSettings
from megatron_ba.train.policy import Policy

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def build_policy(hf_dir: Path) -> list[torch.nn.Module]:
    """The policy's chunks, built by the local trainer's own Policy.from_hf with
    recipes/tiny-cpu.yaml's settings (fp32, the local layer spec with unfused attention on the
    CPU, DDP; its model keys are the tiny model's shape, which from_hf checks)."""
    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml")
    layout = ParallelLayout()  # the world of one this script joins
    return Policy.from_hf(hf_dir, recipe, is_main=True, layout=layout, device=CPU).chunks


def token_aligned(position_aligned: torch.Tensor, fill) -> torch.Tensor:
    """[B, S-1] entries about tokens 1..S-1 -> [B, S] entries about tokens 0..S-1 (token 0:
    `fill`; nothing predicts it)."""
    rows = position_aligned.shape[0]
    first = torch.full((rows, 1), fill, dtype=position_aligned.dtype)
    return torch.cat([first, position_aligned], dim=1)


def grpo_batch(batch: dict) -> GRPOBatch:
    tokens = batch["tokens"].long()
    response_mask = token_aligned(batch["mask"].bool(), False)
    return GRPOBatch(
        tokens=tokens,
        response_mask=response_mask,
        # float32, as the local trainer's Experience holds them
        advantages=batch["advantages"].float(),
        group_ids=batch["group_ids"].long(),
        old_logprobs=token_aligned(batch["old_logprobs"].float(), 0.0),
    )


def step_settings(batch: dict) -> tuple[StepSettings, MicroBatchSpec]:
    s = batch["settings"]
    aggregation = AggregationSettings(
        rule=s["rule"],
        scope=s["scope"],
        reg_rule=s["reg_rule"],
        reg_scope=s["reg_scope"],
        max_length=s["max_length"],
        neutral_eps=s["neutral_eps"],
    )
    loss = GRPOLossConfig(
        clip_low=s["clip_low"],
        clip_high=s["clip_high"],
        dual_clip=s["dual_clip"],
        kl_coef=s["kl_coef"],
    )
    if loss.kl_coef != 0:
        raise ValueError("settings.kl_coef: this script has no reference policy; use 0.0")
    settings = StepSettings(aggregation, loss, temperature=float(s["temperature"]))
    return settings, MicroBatchSpec(int(s["num_microbatches"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", type=Path, required=True, help="Hugging Face Qwen2 folder")
    p.add_argument("--batch", type=Path, required=True, help="BATCH.pt (see the docstring)")
    p.add_argument("--out", type=Path, required=True, help="where to torch.save the result")
    args = p.parse_args()
    # megatron-core warns at import that Apex / Transformer Engine are missing: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    batch = torch.load(args.batch, weights_only=False)
    setup(ParallelLayout(dp=None), seed=0, backend="gloo")
    try:
        chunks = build_policy(args.hf)
        num_groups = int(batch["num_groups"])
        result = forward_backward(
            chunks, grpo_batch(batch), *step_settings(batch), num_groups=num_groups
        )
        # main_grad (DDP's buffers) after finalize_model_grads, by full megatron-core name
        grads = gather_full_state_dict(chunks, grads=True)
    finally:
        teardown()
    torch.save(
        {
            "loss": float(result.loss),
            "grads": {name: g.float() for name, g in grads.items()},
            "metrics": {k: float(v) for k, v in result.metrics.items()},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
