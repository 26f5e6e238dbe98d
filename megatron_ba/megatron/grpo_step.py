"""The GRPO step on megatron-core's schedules: forward/backward and forward-only log-probs.

After torch.distributed and `parallel_state.initialize_model_parallel(tp, pp,
context_parallel_size=cp)`, with `chunks = model.build_model_chunks(spec)` on every rank:

    split = MicroBatchSpec(num_microbatches=4)                           # batching.py
    old, _ = compute_logprobs(chunks, tokens, split)                     # [N, S] on every rank
    batch = GRPOBatch(tokens, response_mask, advantages, group_ids, old)  # batching.GRPOBatch
    settings = StepSettings(AggregationSettings(rule="balanced"))  # megatron_ba.step_settings
    result = forward_backward(chunks, batch, settings, split, num_groups=prompts_per_batch)
    applied, grad_norm = optimizer.step()           # cpu_optimizer.ShardedAdamW(chunks, lr=...)

Every TP, PP and CP rank of a data-parallel rank passes the same batch: that DP rank's sequences,
whole (batching.py cuts the micro-batches and CP shards). Group ids are global in
[0, num_groups); a group may span DP ranks.

Exactness: the loss plan (per-sequence weights) is built once per global batch from whole-sequence
statistics summed over the DP group by one all-reduce (collectives.StatisticsReducer), on the ranks
that compute the loss (the last pipeline stage). Each micro-batch and CP shard then contributes
its exact share L_part of the global loss, multiplied by `loss_scale.loss_scale` to cancel the
schedule's 1/num_microbatches and DDP's 1/(DP x CP) (or finalize_model_grads' 1/num_tokens under
`calculate_per_token_loss`), so the finalised gradient is d(global loss)/d(theta).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.megatron.batching import (
    GRPOBatch,
    MicroBatches,
    MicroBatchSpec,
    logprob_chunk,
    run_schedule,
    schedule_microbatches,
    shape2,
)
from megatron_ba.megatron.loss_scale import loss_scale
from megatron_ba.megatron.model import check_cp_agreement
from megatron_ba.megatron.routing_replay import differ_counts
from megatron_ba.megatron.thd import thd_scatter
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.parallel import collectives
from megatron_ba.step_settings import StepSettings

__all__ = [
    "GRPOBatch",
    "MicroBatchSpec",
    "PreparedStep",
    "StepResult",
    "compute_logprobs",
    "forward_backward",
]


@dataclass
class StepResult:
    """Global metrics of a step (summed over micro-batches, DP and CP; on every rank)."""

    loss: float
    metrics: dict[str, float]  # `*_sum` additive totals; `*_frac`, `ratio_mean` global means
    reducer_calls: int  # statistics all-reduces this rank made (1 on the last stage, else 0)


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def forward_backward(
    chunks: list[torch.nn.Module],
    batch: GRPOBatch,
    settings: StepSettings,
    split: MicroBatchSpec,
    *,
    num_groups: int,
    reducer: collectives.StatisticsReducer | None = None,
) -> StepResult:
    """One forward/backward of the GRPO loss over this rank's batch; gradients finalised.

    Zeroes the DDP gradient buffers, builds the loss plan of the global batch of `num_groups`
    prompt groups (group ids lie in [0, num_groups); one DP all-reduce, last stage only), runs
    the schedule with each micro-batch's rows of it, scaled to cancel megatron-core's
    normalisation (the schedule then calls finalize_model_grads: DP/CP all-reduce, TP-replicated
    and embedding gradients) and returns the global loss and metrics on every rank. `settings`:
    the plan's aggregation, the loss's coefficients, the temperature. `reducer` defaults to a
    StatisticsReducer over the DP group; pass one to count its calls.
    """
    return PreparedStep.start(chunks, batch, split, reducer).run(settings, num_groups)


class PreparedStep:
    """One step's batch cut into finished micro-batches, the model zeroed and set up for the
    schedule's backward; `run` runs the exact step: each micro-batch's rows of the global plan
    (`plan_of`), its whole part counted (`share`), scaled by loss_scale's factor (`scale`). The
    layout check's negative controls are subclasses that override one of the three."""

    def __init__(self, chunks, batch: GRPOBatch, parts: MicroBatches, reducer) -> None:
        ps = _ps()
        config = _ready_for_backward(chunks)
        self.chunks, self.batch, self.parts = chunks, batch, parts
        self.last = ps.is_pipeline_last_stage()
        self.dp = ps.get_data_parallel_world_size()
        self.per_token_loss = bool(config.calculate_per_token_loss)
        if self.last and reducer is None:
            reducer = collectives.StatisticsReducer(ps.get_data_parallel_group())
        self.reducer = reducer

    @classmethod
    def start(cls, chunks, batch: GRPOBatch, split: MicroBatchSpec, reducer=None):
        batch = batch.checked()
        parts = schedule_microbatches(batch, split, sequence_parallel=_splits_sequence(chunks))
        check_cp_agreement(chunks, parts.view.mode, parts.view.cp)  # model CP == batch CP
        return cls(chunks, batch, parts, reducer)

    def plan(
        self, settings: StepSettings, num_groups: int, rows=slice(None), *, reduce="dp"
    ) -> LossPlan:
        """The plan of batch[rows]'s sequences from their statistics summed by `reduce`: the
        global batch's (all rows, summed over DP by the step's reducer) by default."""
        b = self.batch
        return LossPlan.build(
            settings.aggregation,
            b.lengths[rows],
            b.advantages[rows],
            b.group_ids[rows],
            reduce=self.reducer if reduce == "dp" else reduce,
            num_groups=num_groups,
        )

    def plan_of(self, settings: StepSettings, num_groups: int) -> Callable:
        """rows -> a micro-batch's plan: its rows of the global batch's plan (built here, on the
        last stage only, where the loss exists)."""
        plan = self.plan(settings, num_groups) if self.last else None
        return lambda rows: plan.select(rows)

    def share(self) -> float:
        """The share of each micro-batch's loss counted in the step's: all of it."""
        return 1.0

    def scale(self) -> int:
        """The factor cancelling the installed megatron-core's scaling (loss_scale.py)."""
        view = self.parts.view
        return loss_scale(len(self.parts), self.dp, view.cp, per_token_loss=self.per_token_loss)

    def run(self, settings: StepSettings, num_groups: int) -> StepResult:
        """The schedule over the micro-batches: each one's loss is grpo_loss with its plan
        (`plan_of`, padded to its rows), `share` of it counted in the step's loss, times
        `scale` on the way to the gradient."""
        plan_of = self.plan_of(settings, num_groups)
        loss_func = _part_loss(settings, self.parts, plan_of, self.scale(), self.share())
        store = run_schedule(self.chunks, self.parts, forward_only=False, loss_func=loss_func)
        return _global_result(store, self.last, self.reducer)


def _ready_for_backward(chunks: list[torch.nn.Module]):
    """The model's TransformerConfig, set up for the schedule to finalise gradients (DDP's
    no_sync between micro-batches, megatron-core's finalize_model_grads), with every gradient
    buffer zeroed."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    if len(chunks) == 1 and hasattr(chunks[0], "no_sync"):
        config.no_sync_func = chunks[0].no_sync
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=False)
    return config


def _logprobs(output, mb, parts: MicroBatches, *, temperature: float, with_entropy: bool):
    """This micro-batch's per-position log-probs (and entropy), in the shape of its `mask`."""
    ps = _ps()
    tp_group = ps.get_tensor_model_parallel_group()
    out = vocab_parallel_logprobs(
        parts.view.logits_for_loss(output),
        mb["targets"],
        tp_group=tp_group if ps.get_tensor_model_parallel_world_size() > 1 else None,
        temperature=temperature,
        chunk_size=logprob_chunk(parts.logprob_chunk_size, mb["targets"].numel()),
        with_entropy=with_entropy,
    )
    logp, ent = out if with_entropy else (out, None)
    shape = mb["mask"].shape  # packed (THD): [1, total] -> [total]; padded: unchanged
    return logp.reshape(shape), (None if ent is None else ent.reshape(shape))


def _part_loss(settings: StepSettings, parts: MicroBatches, plan_of, scale: float, share: float):
    """The schedule's loss function: each micro-batch's (and CP shard's) part of the GRPO loss,
    times `scale`, with its additive metrics."""
    with_entropy = settings.loss.entropy_coef > 0
    one = torch.ones((), dtype=torch.int, device=parts.parts[0]["targets"].device)

    def loss_func(mb, output):
        logp, ent = _logprobs(
            output, mb, parts, temperature=settings.temperature, with_entropy=with_entropy
        )
        part, metrics = grpo_loss(
            logp,
            mb["old"],
            mb["mask"],
            plan_of(mb["rows"]).padded_to(mb["plan_rows"]),  # padding rows weigh 0
            settings.loss,
            ref_logprobs=mb.get("ref"),
            entropy=ent,
            is_weights=mb.get("is"),
        )
        # `part * share` is this micro-batch's (and CP shard's) share of the step's loss;
        # `scale` is that share times the factor that cancels megatron-core's scaling
        # (loss_scale.py names the lines in schedules.py, distributed_data_parallel.py and
        # finalize_model_grads.py); num_tokens = 1 per micro-batch makes every divisor
        # megatron-core applies a count known in advance.
        return part * scale, one, _additive(part, metrics, share)

    return loss_func


def _additive(
    part: torch.Tensor, metrics: dict[str, torch.Tensor], share: float = 1.0
) -> dict[str, torch.Tensor]:
    """Metrics that add up over parts: sums, and per-part fractions turned into counts. The
    loss terms count `share` of this part's (1 but for the per-micro-batch control)."""
    out = {"loss_sum": part.detach() * share}
    n = metrics["num_tokens_sum"]
    for k, v in metrics.items():
        if k.endswith("_sum"):
            out[k] = v
        elif k.endswith("_frac") or k == "ratio_mean":
            out[k + "_sum"] = v * n
        elif k in ("kl", "entropy", "pg_loss"):
            out[k + "_sum"] = v * share
    return out


def _global_result(store, last: bool, reducer) -> StepResult:
    """Per-micro-batch metrics summed over DP x CP on the last stage, then sent to every stage."""
    ps = _ps()
    metrics = collectives.sum_microbatch_metrics(
        store,
        last=last,
        dp_group=ps.get_data_parallel_group(with_context_parallel=True),
        pp_group=ps.get_pipeline_model_parallel_group(),
    )
    n = metrics.get("num_tokens_sum", 0.0)
    for k in list(metrics):
        if (k.endswith("_frac_sum") or k == "ratio_mean_sum") and n > 0:
            metrics[k[: -len("_sum")]] = metrics[k] / n
    calls = reducer.calls if (last and reducer is not None) else 0
    return StepResult(loss=metrics.get("loss_sum", 0.0), metrics=metrics, reducer_calls=calls)


def _splits_sequence(chunks) -> bool:
    """Whether the model scatters each micro-batch's positions over its TP ranks."""
    return bool(getattr(chunks[0].config, "sequence_parallel", False))


@torch.no_grad()
def compute_logprobs(
    chunks: list[torch.nn.Module],
    tokens: torch.Tensor,
    split: MicroBatchSpec | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    seq_tokens: list[int] | None = None,
    routed_experts: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    routing_differ: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `tokens` under the model, through the same schedule.

    Returns token-aligned fp32 [N, S] tensors (position 0 is 0: nothing predicts it) on every
    TP, PP and CP rank of this DP rank: the old or reference log-probs of a GRPO step. `split`
    (default one micro-batch): as in forward_backward. Under its token budget, row i is run on
    its first `seq_tokens[i]` tokens (default all S; pass batching.response_end(response_mask)
    to skip the right padding); positions past a row's tokens are 0.

    routed_experts ([N, S, L, K]): the experts to replay (megatron_ba.megatron.routing_replay);
    with it, `routing_differ` (a list) gets routing_replay.differ_counts over `response_mask`'s
    tokens: how often the routers' own choice differs from the replayed one.
    """
    split = split or MicroBatchSpec()
    n, s = shape2("tokens", tokens)
    if split.max_tokens_per_microbatch is not None and seq_tokens is None:
        seq_tokens = [s] * n
    batch = _tokens_only_batch(tokens, routed_experts, response_mask)
    parts = schedule_microbatches(
        batch, split, seq_tokens=seq_tokens, sequence_parallel=_splits_sequence(chunks)
    )
    check_cp_agreement(chunks, parts.view.mode, parts.view.cp)  # model CP == batch CP

    def loss_func(mb, output):  # no loss: the log-probs (and entropy) as the micro-batch's metrics
        logp, ent = _logprobs(output, mb, parts, temperature=temperature, with_entropy=with_entropy)
        res = {"logprobs": logp} if ent is None else {"logprobs": logp, "entropy": ent}
        zero = torch.zeros((), dtype=torch.float32, device=tokens.device)
        return zero, torch.ones((), dtype=torch.int, device=tokens.device), res

    differ = [] if routing_differ is not None and routed_experts is not None else None
    store = run_schedule(chunks, parts, forward_only=True, loss_func=loss_func, differ=differ)
    if differ is not None:
        routing_differ.append(differ_counts(differ, parts.parts))
    keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    outs = [_token_aligned(store, parts.parts, key, tokens) for key in keys]
    return outs[0], (outs[1] if with_entropy else None)


def _tokens_only_batch(tokens: torch.Tensor, routed=None, mask=None) -> GRPOBatch:
    """`tokens` as a batch for the schedule: zero advantages and log-probs; the response mask
    (default none) only marks where the routing diagnostic counts."""
    n, s = tokens.shape
    dev = tokens.device
    return GRPOBatch(
        tokens,
        torch.zeros_like(tokens, dtype=torch.bool) if mask is None else mask.bool(),
        torch.zeros(n, device=dev),
        torch.zeros(n, dtype=torch.long, device=dev),
        torch.zeros(n, s, device=dev),
        routed_experts=routed,
    )


def _token_aligned(store: list, data: list, key: str, tokens: torch.Tensor) -> torch.Tensor:
    """The [N, S] fp32 tensor of the micro-batches' `key` outputs, token-aligned (position p
    holds what position p - 1 predicted), assembled on the last stage from its micro-batches
    (CP shards gathered, THD parts scattered) and sent to every pipeline stage."""
    ps = _ps()
    n, s = tokens.shape
    full = None
    if ps.is_pipeline_last_stage():
        full = torch.zeros(n, s, dtype=torch.float32, device=tokens.device)
        for mb, d in zip(data, store, strict=True):  # d[key]: the shape of mb's mask
            if "packed_seq_params" in mb:  # THD: [total], CP = 1
                thd_scatter(d[key].float(), mb, full)
                continue
            whole = collectives.gather_context_parallel(
                d[key].float(), dim=1, group=ps.get_context_parallel_group()
            )[: mb["num_rows"]]
            w = min(mb["width"], s - 1)
            full[mb["rows"], 1 : 1 + w] = whole[:, :w]  # position p predicts token p + 1
    return collectives.broadcast_from_last_stage(
        full,
        shape=(n, s),
        dtype=torch.float32,
        group=ps.get_pipeline_model_parallel_group(),
    ).to(tokens.device)
