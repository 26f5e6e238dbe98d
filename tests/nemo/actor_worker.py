"""Runs the GRPO actor (and NeMo-Aligner's own actor) on CPU and saves what the tests compare.

    python tests/nemo/actor_worker.py --tp 1 --out DIR    # one process
    python tests/nemo/actor_worker.py --tp 2 --out DIR    # two gloo processes (TP=2)

TP=1 saves: the core's single-process reference (one pass over the whole batch, float64
log-softmax, `LossPlan.build` + `grpo_loss`, autograd), the actor's loss/gradients through
NeMo-Aligner's `get_loss_and_metrics` (3 micro-batches of 2), the negative control (NeMo-Aligner's
REINFORCE actor vs ours with the token-mean rule, on-policy, at 1 and 3 micro-batches), the actor
with `model.grpo.rule: group_token_mean` against the rule's float64 definition
(tests/rule_reference.py) and one step of NeMo's plain `adamw`. TP=2 saves the actor's loss and
full (gathered) gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rule_reference
import nemo_helpers as H
from rule_reference import clipped_terms, group_token_mean_objective

B, MBS = 6, 2  # 3 micro-batches of 2 sequences
FC1 = "mlp.linear_fc1.weight"  # SwiGLU's fused [gate; up]: rank r holds [gate_r; up_r]


def _stride(name: str, param) -> int:
    return 2 if name.endswith(FC1) else int(getattr(param, "partition_stride", 1))


def load_full(model, full: dict, tp: int) -> None:
    from megatron.core import parallel_state as ps

    from megatron_ba.parallel.sharding import tp_shard

    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            src = full[name]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                src = tp_shard(
                    src, dim=int(p.partition_dim), stride=_stride(name, p), rank=rank, size=tp
                )
            p.copy_(src.to(p.dtype))


def gather_grads(model, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_ba.parallel import collectives

    out = {}
    for name, p in model.model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            g = collectives.gather_tensor_parallel(
                g,
                dim=int(p.partition_dim),
                stride=_stride(name, p),
                group=ps.get_tensor_model_parallel_group(),
            )
        out[name] = g.double()
    return out


def make_batch(eos: int, seed: int = 7) -> dict:
    """6 responses in 2 groups of 3, unequal prompt and response lengths, mixed rewards."""
    from megatron_ba.advantages import group_advantages

    g = torch.Generator().manual_seed(seed)
    s = H.SEQ
    tokens = torch.randint(3, H.VOCAB, (B, s), generator=g)
    prompt_len = torch.tensor([3, 5, 4, 3, 6, 4])
    total_len = torch.tensor([24, 9, 16, 12, 20, 7])  # prompt + response (NeMo's response_lengths)
    mask = torch.zeros(B, s - 1)
    for i in range(B):
        tokens[i, total_len[i] :] = eos
        mask[i, prompt_len[i] - 1 : total_len[i] - 1] = 1.0  # as nemo_aligner's create_mask
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, gids).advantages
    return {"response_tokens": tokens, "mask": mask, "advantages": adv.float(), "group_ids": gids}


def current_logprobs(model, tokens) -> torch.Tensor:
    """[B, S-1] float64 log-probs of tokens[:, 1:] under the model, one pass, TP=1 only."""
    att, _, pos = model.get_ltor_masks_and_position_ids(tokens)
    logits = model.model(tokens, pos, att, labels=None)
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def core_reference(model, batch: dict, settings) -> tuple[float, dict]:
    """The core's single-process loss and gradients on the whole batch (the ground truth)."""
    from megatron_ba.loss import LossPlan, grpo_loss
    from megatron_ba.loss_settings import AggregationSettings

    model.model.zero_grad(set_to_none=True)
    logp = current_logprobs(model, batch["response_tokens"])
    mask = batch["mask"].bool()
    plan = LossPlan.build(
        AggregationSettings(
            settings.rule,
            scope=settings.scope,
            reg_rule=settings.reg_rule,
            reg_scope=settings.reg_scope,
        ),
        mask.sum(1).double(),
        batch["advantages"].double(),
        batch["group_ids"],
        num_groups=settings.num_groups,
    )
    loss, _ = grpo_loss(logp, batch["logprobs"].double(), mask, plan, settings.loss)
    loss.backward()
    return loss.item(), {
        n: p.grad.detach().double().clone() for n, p in model.model.named_parameters()
    }


def actor_step(model, batch: dict, tp: int, mbs: int, gbs: int) -> tuple[float, dict, dict]:
    from megatron.core import parallel_state as ps
    from nemo_aligner.utils.utils import configure_batch_sizes

    configure_batch_sizes(mbs=mbs, gbs=gbs, dp=ps.get_data_parallel_world_size())
    model.cfg.micro_batch_size = mbs  # read by get_loss_and_metrics for the schedule
    model.model.zero_grad(set_to_none=True)
    loss, metrics = model.get_loss_and_metrics(
        batch={k: v.clone() for k, v in batch.items()}, forward_only=False
    )
    model.finish_training_step()  # NeMo's grad_reductions (the DP mean our scale cancels)
    return loss, gather_grads(model, tp), metrics


def worker(rank: int, world: int, port: int, tp: int, out: str) -> None:
    H.start(rank, world, port, tp)
    from megatron_ba.integrations.nemo_aligner.actor import MegatronGPTGRPOActorModel

    tok = H.tokenizer_dir(Path(out))
    cfg = H.actor_config(tok, tp=tp, mbs=MBS, gbs=B, grpo={"rule": "balanced", "scope": "group"})
    cfg.reinforce.num_rollout_samples = 2  # groups per step
    actor = H.build(MegatronGPTGRPOActorModel, cfg)
    full = H.full_weights(actor, tp)
    load_full(actor, full, tp)
    actor.model.train()
    batch = make_batch(actor.tokenizer.eos_id)
    # Off-policy old log-probs: the TP=1 model's own plus a fixed perturbation, so that ratios
    # leave the clip range on some tokens; TP=2 reads the same ones from the TP=1 run.
    result: dict = {}
    cur_path = Path(out) / "current_logprobs.pt"
    if tp == 1:
        with torch.no_grad():
            torch.save(current_logprobs(actor, batch["response_tokens"]).float(), cur_path)
    cur = torch.load(cur_path)
    g = torch.Generator().manual_seed(11)
    batch["logprobs"] = cur + 0.3 * torch.randn(cur.shape, generator=g)
    if tp == 1:
        result["ref_loss"], result["ref_grads"] = core_reference(actor, batch, actor.grpo)
    result["loss"], result["grads"], result["metrics"] = actor_step(actor, batch, tp, MBS, B)
    result["reducer_calls"] = actor.last_reducer.calls
    if tp == 1:
        result.update(group_token_mean_run(actor, batch))
        result.update(negative_control(actor, cfg, full, batch, cur))
        result.update(optimizer_step(actor, cfg))
    if rank == 0:
        torch.save(result, Path(out) / f"tp{tp}.pt")


def group_token_mean_run(actor, batch: dict) -> dict:
    """The actor with rule group_token_mean at scope batch (the rule stays per prompt) through
    NeMo-Aligner's loop, and the rule's float64 definition on the whole batch: minus the mean over
    prompts of each prompt's token mean of the PPO term; as the control, the same definition with
    the batch as one group (the batch token mean)."""
    saved = actor.grpo
    actor.grpo = dataclasses.replace(saved, rule="group_token_mean", scope="batch")
    out = {}
    out["gtm_loss"], out["gtm_grads"], _ = actor_step(actor, batch, 1, MBS, B)
    actor.grpo = saved
    mask, gids = batch["mask"].bool(), batch["group_ids"]
    for name, groups in (("gtm_ref", gids), ("gtm_pooled", torch.zeros_like(gids))):
        actor.model.zero_grad(set_to_none=True)
        logp = current_logprobs(actor, batch["response_tokens"])
        phi = clipped_terms(logp, batch["logprobs"], batch["advantages"], saved.clip_low,
                            saved.clip_high, saved.dual_clip)  # fmt: skip
        loss = -group_token_mean_objective(phi, mask, groups)
        loss.backward()
        out[f"{name}_loss"] = loss.item()
        out[f"{name}_grads"] = {
            n: p.grad.detach().double().clone() for n, p in actor.model.named_parameters()
        }
    return out


def negative_control(actor, cfg, full: dict, batch: dict, cur: torch.Tensor) -> dict:
    """NeMo-Aligner's own REINFORCE actor vs ours with the token-mean rule, on-policy.

    On-policy (old = current log-probs) the clipped loss's gradient is -A grad(logp), REINFORCE's
    with rewards_with_kl - baseline = A: the two differ only in how tokens are normalised (a
    global token mean vs NeMo-Aligner's mean of per-micro-batch token means).
    """
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import (
        MegatronGPTReinforceActorModel,
    )

    theirs = H.build(MegatronGPTReinforceActorModel, cfg)
    load_full(theirs, full, 1)
    theirs.model.train()
    ours_cfg = dataclasses.replace(actor.grpo, rule="token", scope="batch")
    saved, actor.grpo = actor.grpo, ours_cfg
    on_policy = dict(batch, logprobs=cur.clone())
    nemo_batch = {
        "response_tokens": batch["response_tokens"],
        "mask": batch["mask"],
        # [B, 1]: the parent multiplies [B, S-1] log-probs by these (a [B] shape only
        # broadcasts when B = 1, which is why its configs pin micro_batch_size: 1)
        "rewards_with_kl": batch["advantages"][:, None],
        "baseline": torch.zeros(B, 1),
        "is_end": torch.ones(B),
    }
    out = {}
    for mbs in (B, MBS):  # 1 micro-batch, then 3
        _, ours, _ = actor_step(actor, on_policy, 1, mbs, B)
        _, nemo, _ = actor_step(theirs, nemo_batch, 1, mbs, B)
        out[f"control_ours_mbs{mbs}"], out[f"control_nemo_mbs{mbs}"] = ours, nemo
    actor.grpo = saved
    return out


def optimizer_step(actor, cfg) -> dict:
    """One step of NeMo's plain `adamw` (cfg.optim) on the actor's last gradients."""
    actor.setup_optimization(optim_config=cfg.optim)
    opt = actor._optimizer
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in actor.model.named_parameters()}
    opt.step()
    after = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    return {
        "opt_name": type(opt).__name__,
        "opt_before": before,
        "opt_after": after,
        "opt_grads": grads,
        "opt_lr": float(cfg.optim.lr),
        "opt_eps": float(opt.param_groups[0]["eps"]),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    port = _free_port()
    if args.tp == 1:
        worker(0, 1, port, 1, args.out)
    else:
        torch.multiprocessing.spawn(worker, args=(args.tp, port, args.tp, args.out), nprocs=args.tp)
