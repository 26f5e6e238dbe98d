"""One GRPO update on megatron-core: old/reference log-probs, then the loss plan's optimiser steps.

    metrics = grpo_update(chunks, ref_chunks, optimizer, recipe.step_settings(), ctx, experience)

The experience is moved to `ctx.device` first (cuda:LOCAL_RANK on GPUs); every other tensor of
the step is made on its inputs' device.

Everything the update is configured by arrives in one StepSettings (megatron_ba.step_settings,
built once from the recipe). `mini_batches` (grpo.mini_batches) splits the step's prompt groups
into that many global batches, each with its own plan (one statistics all-reduce over
data-parallel ranks) and optimiser step; the old (and reference) log-probs of all of them are
computed first, through the same schedule, so from the second mini-batch on the ratio moves away
from 1 and the clip acts.

The rollout correction (loss.rollout_correction): each mini-batch's old log-probs and the
rollout engine's give its per-token weights (and, rejecting, its smaller mask and lengths) before
its plan is built; every rank corrects its own whole sequences (rollout_correction.correct_rows,
as the layout check does), and the diagnostics' sums
are all-reduced over data-parallel ranks. The log-prob gap is logged whenever the engine returned
log-probs, with the correction off too (one subtraction per token).

`rollout.routing_replay`: the old-log-prob and training forwards replay the experts the engine
routed each token to (the reference policy routes by itself); `routing/replay_differ_frac` is the
fraction of (response token, MoE layer) pairs whose router, in the old-log-prob forward, would
have chosen another top-k set than the engine did.
"""

from __future__ import annotations

import torch

from megatron_ba.megatron.batching import response_end
from megatron_ba.megatron.grpo_step import (
    GRPOBatch,
    MicroBatchSpec,
    compute_logprobs,
    forward_backward,
)
from megatron_ba.megatron.model import model_cp_size
from megatron_ba.megatron.packing import balanced_dp_shards
from megatron_ba.parallel import collectives
from megatron_ba.rollout_correction import WEIGHT_MAX, correct_rows, correction_diagnostics
from megatron_ba.step_settings import StepSettings
from megatron_ba.train.experience import Experience


def microbatch_spec(settings: StepSettings, rows: int, cp_mode: str) -> MicroBatchSpec:
    """How a rank's `rows` sequences are split for the schedule (settings.micro_batching)."""
    mb = settings.micro_batching
    return MicroBatchSpec(
        mb.count(rows),
        max_tokens_per_microbatch=mb.max_tokens_per_microbatch,
        logprob_chunk_size=mb.logprob_chunk_size,
        cp_mode=cp_mode,
    )


def cp_mode_of(chunks) -> str:
    """How the batch must reach this model under CP: sharded ("model": it runs CP attention,
    Transformer Engine) or whole ("loss": built without CP, the local spec)."""
    return "model" if model_cp_size(chunks[0]) > 1 else "loss"


def grpo_update(
    chunks, ref_chunks, optimizer, settings: StepSettings, ctx, exp: Experience
) -> dict:
    """`settings.mini_batches` optimiser steps on the batch; metrics averaged over them.

    Mini-batch j holds whole prompt groups [j P/m, (j+1) P/m) and is a global batch of its
    own: its plan is built from its groups only (one statistics all-reduce each). The old
    (and reference) log-probs of every mini-batch are computed before the first update, so
    from the second mini-batch on the ratio moves away from 1 and the clip acts.
    """
    # Every tensor of the step on this rank's device: the batch goes there once (the broadcast
    # delivers it to every rank on the CPU); grpo_step's tensors follow their inputs.
    exp = exp.to(ctx.device)
    m = settings.mini_batches
    cp_mode = cp_mode_of(chunks)
    groups_per = exp.num_groups // m
    differ: list = []  # routing replay's diagnostic counts, one per mini-batch
    parts = [
        _old_logprobs(chunks, ref_chunks, settings, ctx, exp, j, cp_mode, differ) for j in range(m)
    ]
    totals: dict[str, float] = {}
    grad_norms, applied = [], []
    token_entropy, n_tokens = 0.0, 0
    stats = []
    for j, (rows, split, old, ref, entropy) in enumerate(parts):
        mask, weights, stat = _corrected(settings, exp, rows, old)
        stats.append(stat)
        batch = GRPOBatch(
            tokens=exp.tokens[rows],
            response_mask=mask,
            advantages=exp.advantages[rows],
            group_ids=exp.group_ids[rows] - j * groups_per,
            old_logprobs=old,
            ref_logprobs=ref,
            lengths=mask.sum(dim=1),
            is_weights=weights,
            routed_experts=None if exp.routed_experts is None else exp.routed_experts[rows],
        )
        result = forward_backward(chunks, batch, settings, split, num_groups=groups_per)
        ok, norm = optimizer.step()
        applied.append(bool(ok))
        grad_norms.append(norm)
        for k, v in result.metrics.items():
            totals[k] = totals.get(k, 0.0) + v / m
        mask = batch.response_mask
        token_entropy += float(entropy[mask].sum())
        n_tokens += int(mask.sum())
    return (
        _with_diagnostics(stats, ctx)
        | _routing_differ(differ, ctx)
        | {
            "pg_loss": totals.get("pg_loss_sum", float("nan")),
            "loss": totals.get("loss_sum", float("nan")),
            "clip_low_frac": totals.get("clip_low_frac", 0.0),
            "clip_high_frac": totals.get("clip_high_frac", 0.0),
            "ratio_mean": totals.get("ratio_mean", 1.0),
            "kl": totals.get("kl_sum") if ref_chunks is not None else None,
            "entropy": token_entropy / n_tokens if n_tokens else float("nan"),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "updates_applied": sum(applied),
        }
    )


def _old_logprobs(chunks, ref_chunks, settings, ctx, exp: Experience, j: int, cp_mode, differ):
    """(rows, split, old, ref, entropy) of mini-batch j on this rank: its rows (balanced by
    tokens under a token budget), its micro-batch split, and the old (and reference) log-probs;
    with routing replay the old forward replays the engine's experts and adds its diagnostic
    counts to `differ`."""
    m = settings.mini_batches
    seq_tokens = None
    if settings.micro_batching.max_tokens_per_microbatch:  # DP shards balanced by tokens
        mini = exp.rows(1, 0, mini_batches=m, index=j)
        ends = response_end(exp.response_mask[mini])  # one host read per mini-batch
        mine = balanced_dp_shards(ends, ctx.dp)[ctx.dp_rank]
        rows = mini[torch.tensor(mine, dtype=torch.long)]
        seq_tokens = [ends[i] for i in mine]
    else:
        rows = exp.rows(ctx.dp, ctx.dp_rank, mini_batches=m, index=j)
    split = microbatch_spec(settings, len(rows), cp_mode)  # sizes differ by one where needed
    kw = dict(temperature=settings.temperature, seq_tokens=seq_tokens)
    old, entropy = compute_logprobs(
        chunks,
        exp.tokens[rows],
        split,
        with_entropy=True,
        routed_experts=None if exp.routed_experts is None else exp.routed_experts[rows],
        response_mask=exp.response_mask[rows],
        routing_differ=differ,
        **kw,
    )
    ref = None
    if ref_chunks is not None:
        ref, _ = compute_logprobs(ref_chunks, exp.tokens[rows], split, **kw)
    return rows, split, old, ref, entropy


def _corrected(settings: StepSettings, exp: Experience, rows, old: torch.Tensor):
    """(response mask, is_weights or None, correction statistics or None) of the rows: the
    rollout correction on this rank's whole sequences, before the plan is built (a rejected
    token leaves the mask, hence the lengths); without engine log-probs, none."""
    mask = exp.response_mask[rows]
    if exp.rollout_logprobs is None:
        return mask, None, None
    return correct_rows(settings.rollout_correction, old, exp.rollout_logprobs[rows], mask)


def _with_diagnostics(stats: list, ctx) -> dict[str, float]:
    """The `rollout_correction/*` diagnostics of the step: the mini-batches' statistics summed
    (their max taken), then reduced over data-parallel ranks. {} without engine log-probs."""
    if not stats or stats[0] is None:
        return {}
    table = torch.stack(stats)
    total = table.sum(dim=0)
    total[WEIGHT_MAX] = table[:, WEIGHT_MAX].max()
    if ctx.dp > 1:
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        peak = collectives.all_reduce_max_(total[WEIGHT_MAX : WEIGHT_MAX + 1].clone(), group)
        total = collectives.all_reduce_sum(total, group=group)
        total[WEIGHT_MAX] = peak[0]
    return correction_diagnostics(total)


def _routing_differ(differ: list, ctx) -> dict[str, float]:
    """`routing/replay_differ_frac` of the step (summed over mini-batches and data-parallel
    ranks); {} without routing replay."""
    if not differ:
        return {}
    total = torch.stack(differ).sum(dim=0)
    if ctx.dp > 1:
        from megatron.core import parallel_state as ps

        total = collectives.all_reduce_sum(total, group=ps.get_data_parallel_group())
    return {"routing/replay_differ_frac": float(total[0] / total[1]) if total[1] else 0.0}
