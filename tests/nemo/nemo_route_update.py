"""One GRPO loss and gradient through the NeMo-Aligner route, for the cross-route test.

    python tests/nemo/nemo_route_update.py --hf HF_DIR --batch BATCH.pt --out OUT.pt \
        [--per-microbatch-mean]

Runs in .venv-nemo (one gloo process): our GRPO actor (NeMo's `MegatronGPTModel` with the Hugging
Face folder's weights, converted as `megatron-ba nemo-tiny-model` does) takes the batch through
NeMo-Aligner's `get_loss_and_metrics` (megatron-core 0.10's schedule, the batch's
num_microbatches) and saves {"loss", "grads" (by megatron-core name, float32), "metrics"}.
tests/nemo/local_route_update.py computes the same with the local backend's route in the main
environment; tests/nemo/test_nemo_cross_route.py compares them. BATCH.pt's keys are that
script's. --per-microbatch-mean swaps the BA weights for NeMo-Aligner's per-micro-batch mean
(the negative control).
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nemo_helpers as H


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_actor(hf_dir: Path, batch: dict):
    """Our actor with the HF folder's weights and the batch's GRPO settings (TP=1)."""
    from omegaconf import OmegaConf, open_dict

    from megatron_ba.commands.nemo_tiny_model import load_hf_weights, nemo_model_config
    from megatron_ba.conversion import spec_from_hf_dir
    from megatron_ba.integrations.nemo_aligner.actor import MegatronGPTGRPOActorModel

    spec = spec_from_hf_dir(hf_dir)
    cfg = OmegaConf.create(nemo_model_config(spec, hf_dir))
    n, m = batch["tokens"].size(0), int(batch["settings"]["num_microbatches"])
    grpo = {k: v for k, v in batch["settings"].items() if k != "num_microbatches"}
    with open_dict(cfg):
        cfg.micro_batch_size, cfg.global_batch_size = n // m, n
        cfg.reinforce = H.actor_config(hf_dir, mbs=n // m, gbs=n).reinforce
        cfg.reinforce.num_rollout_samples = int(batch["num_groups"])  # this batch's prompts
        cfg.grpo = {**grpo, "num_groups": int(batch["num_groups"])}
    actor = H.build(MegatronGPTGRPOActorModel, cfg)
    load_hf_weights(actor, hf_dir, spec)
    actor.model.train()
    return actor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--batch", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-microbatch-mean", action="store_true")
    a = p.parse_args()
    H.start(0, 1, _free_port(), 1)
    batch = torch.load(a.batch, weights_only=False)
    if a.per_microbatch_mean:
        from per_microbatch_mean_train_grpo import _per_microbatch_mean

        from megatron_ba.integrations.nemo_aligner.actor import MegatronGPTGRPOActorModel

        cls = MegatronGPTGRPOActorModel
        cls.build_plan = _per_microbatch_mean(cls.build_plan)
    actor = build_actor(a.hf, batch)
    rollout = {
        "response_tokens": batch["tokens"],
        "mask": batch["mask"],
        "advantages": batch["advantages"].float(),
        "logprobs": batch["old_logprobs"],
        "group_ids": batch["group_ids"],
    }
    n, m = batch["tokens"].size(0), int(batch["settings"]["num_microbatches"])
    from actor_worker import actor_step

    loss, grads, metrics = actor_step(actor, rollout, tp=1, mbs=n // m, gbs=n)
    torch.save(
        {"loss": float(loss), "grads": {k: g.float() for k, g in grads.items()},
         "metrics": {k: float(v) for k, v in metrics.items()}},
        a.out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
