"""The GRPO step on megatron-core's schedules: forward/backward and forward-only log-probs.

After torch.distributed and `parallel_state.initialize_model_parallel(tp, pp,
context_parallel_size=cp)`, with `chunks = model.build_model_chunks(spec)` on every rank:

    old, _ = compute_logprobs(chunks, tokens, num_microbatches=4)       # [N, S] on every rank
    batch = GRPOBatch(tokens, response_mask, advantages, group_ids, old)  # batching.GRPOBatch
    cfg = StepConfig(num_groups=prompts_per_global_batch, num_microbatches=4,
                     aggregation=AggregationSettings(rule="balanced"))
    result = forward_backward(chunks, batch, cfg)   # finalised gradients in param.main_grad
    applied, grad_norm = optimizer.step()           # cpu_optimizer.ShardedAdamW(chunks, lr=...)

Every TP, PP and CP rank of a data-parallel rank passes the same batch: that DP rank's sequences,
whole (this module cuts the CP shards). Group ids are global in [0, num_groups); a group may span
DP ranks. Layout of the tensors: megatron_ba.megatron.batching.

Exactness: the loss plan (per-sequence weights) is built once per global batch from whole-sequence
statistics summed over the DP group by one all-reduce (collectives.StatisticsReducer), on the ranks
that compute the loss (the last pipeline stage). Each micro-batch and CP shard then contributes
its exact share L_part of the global loss, multiplied by `loss_scale.loss_scale` to cancel the
schedule's 1/num_microbatches and DDP's 1/(DP x CP) (or finalize_model_grads' 1/num_tokens under
`calculate_per_token_loss`), so the finalised gradient is d(global loss)/d(theta).

Context parallelism, `StepConfig.cp_mode`:
  * "model": the model runs CP attention (Transformer Engine, GPUs) on the load-balanced shards.
  * "loss" (default without CUDA): megatron-core's attention cannot run CP on CPU, so the model
    sees whole sequences and the logits are sharded the same way before the loss. Parallel state,
    schedules, DDP and the statistics reduction all run with the real CP size; build the model
    with `model.model_pg_collection_without_cp()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.megatron.batching import (
    CPView,
    GRPOBatch,
    prepare_microbatches,
    run_schedule,
    shape2,
)
from megatron_ba.megatron.loss_scale import loss_scale
from megatron_ba.megatron.model import check_cp_agreement
from megatron_ba.megatron.thd import thd_scatter
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.parallel import collectives
from megatron_ba.recipe import AUTO_CHUNK, AUTO_CHUNK_ABOVE
from megatron_ba.rules import AggregationSettings

__all__ = [
    "GRPOBatch",
    "LossNormalization",
    "StepConfig",
    "StepResult",
    "compute_logprobs",
    "forward_backward",
]

CP_MODES = ("model", "loss")


@dataclass(frozen=True)
class StepConfig:
    """How one GRPO step aggregates and splits its batch."""

    num_groups: int  # global number of prompt groups (group ids lie in [0, num_groups))
    num_microbatches: int = 1  # per DP rank (need not divide its sequences); see max_tokens
    # parallel.max_tokens_per_microbatch: pack each micro-batch up to this many tokens (rows x
    # longest, see batching.prepare_microbatches) instead of num_microbatches equal parts.
    max_tokens_per_microbatch: int | None = None
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)  # the plan
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    temperature: float = 1.0  # the sampler's: logits are divided by it before the softmax
    # parallel.logprob_chunk_size: tokens per chunk of the vocab-parallel log-softmax; None:
    # auto (chunked above AUTO_CHUNK_ABOVE tokens per micro-batch, see logprob_chunk).
    logprob_chunk_size: int | None = None
    cp_mode: str | None = None  # "model" | "loss"; default "loss" without CUDA, else "model"
    explicit_causal_mask: bool | None = None  # default: True without CUDA (local attention)
    # Packed (THD) micro-batches under a token budget: None = auto (CUDA, cp_mode "model");
    # needs Transformer Engine attention (megatron_ba.megatron.thd; status: docs/status.md).
    thd: bool | None = None


class LossNormalization:
    """How the step's loss is cut into parts and scaled: the exact way, which training uses.

    The plan is built once per global batch from statistics summed over DP (`global_plan`, on
    the last pipeline stage), each micro-batch (and CP shard) takes its rows of it (`part_plan`),
    so the parts' losses add up to the step's loss (`part_share` 1), and each part is multiplied
    by the factor that cancels the installed megatron-core's scaling (`scale`). The layout check
    subclasses it for its negative controls (megatron_ba.megatron.layout_equivalence.cases).
    """

    def global_plan(self, cfg: StepConfig, batch: GRPOBatch, reducer) -> LossPlan | None:
        return loss_plan(cfg, batch, slice(None), reducer)

    def part_plan(self, plan: LossPlan | None, cfg: StepConfig, batch: GRPOBatch, rows):
        return plan.select(rows)

    def part_share(self, num_parts: int, dp: int) -> float:
        """The share of the step's loss one part's loss is."""
        return 1.0

    def scale(self, num_parts: int, dp: int, cp: int, *, per_token_loss: bool) -> int:
        return loss_scale(num_parts, dp, cp, per_token_loss=per_token_loss)


EXACT = LossNormalization()


@dataclass
class StepResult:
    """Global metrics of a step (summed over micro-batches, DP and CP; on every rank)."""

    loss: float
    metrics: dict[str, float]  # `*_sum` additive totals; `*_frac`, `ratio_mean` global means
    reducer_calls: int  # statistics all-reduces this rank made (1 on the last stage, else 0)


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def _cp_view(cp_mode: str | None, explicit_causal_mask: bool | None) -> CPView:
    cuda = torch.cuda.is_available()
    mode = cp_mode or ("model" if cuda else "loss")
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode: unknown value {mode!r}; expected one of {', '.join(CP_MODES)}")
    mask = (not cuda) if explicit_causal_mask is None else explicit_causal_mask
    ps = _ps()
    cp = ps.get_context_parallel_world_size()
    if mask and mode == "model" and cp > 1:
        raise ValueError("explicit_causal_mask: a whole-sequence mask cannot go with CP shards")
    return CPView(cp=cp, rank=ps.get_context_parallel_rank(), mode=mode, causal_mask=mask)


def _use_thd(setting: bool | None, max_tokens: int | None, view: CPView) -> bool:
    """Packed (THD) micro-batches: only under a token budget; auto = CUDA with CP in the model."""
    if max_tokens is None:
        return False
    if setting is None:
        return torch.cuda.is_available() and view.mode == "model" and view.cp == 1
    return bool(setting)


def logprob_chunk(setting: int | None, num_tokens: int) -> int | None:
    """The chunk size of a micro-batch's log-softmax: `setting` (parallel.logprob_chunk_size)
    when an int, else auto: AUTO_CHUNK above AUTO_CHUNK_ABOVE tokens, unchunked (None) below."""
    if setting is None:
        return AUTO_CHUNK if num_tokens > AUTO_CHUNK_ABOVE else None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting <= 0:
        raise ValueError(
            f"parallel.logprob_chunk_size: must be a positive number of tokens or null (auto: "
            f"chunked above {AUTO_CHUNK_ABOVE} tokens), got {setting!r}"
        )
    return setting


def _logprobs(output, mb, view: CPView, *, temperature, chunk_size, with_entropy):
    ps = _ps()
    tp_group = ps.get_tensor_model_parallel_group()
    logits = view.logits_for_loss(output)
    out = vocab_parallel_logprobs(
        logits,
        mb["targets"],
        tp_group=tp_group if ps.get_tensor_model_parallel_world_size() > 1 else None,
        temperature=temperature,
        chunk_size=logprob_chunk(chunk_size, mb["targets"].numel()),
        with_entropy=with_entropy,
    )
    return out if with_entropy else (out, None)


def forward_backward(
    chunks: list[torch.nn.Module],
    batch: GRPOBatch,
    cfg: StepConfig,
    *,
    reducer: collectives.StatisticsReducer | None = None,
    normalization: LossNormalization = EXACT,
) -> StepResult:
    """One forward/backward of the GRPO loss over this rank's batch; gradients finalised.

    Zeroes the DDP gradient buffers, builds the loss plan (one DP all-reduce, last stage only),
    runs the schedule (which calls megatron-core's finalize_model_grads: DP/CP all-reduce,
    TP-replicated and embedding gradients) and returns the global loss and metrics on every rank.
    `reducer` defaults to a StatisticsReducer over the DP group; pass one to count its calls.
    `normalization`: how the loss is cut into parts and scaled (the exact way by default).
    """
    batch = batch.checked()
    view = _cp_view(cfg.cp_mode, cfg.explicit_causal_mask)
    check_cp_agreement(chunks, view.mode, view.cp)  # model CP == batch CP sharding, or raise
    ps = _ps()
    config = _ready_for_backward(chunks)
    last = ps.is_pipeline_last_stage()
    plan = None
    if last:  # the loss, hence the plan, exists on the last pipeline stage only
        if reducer is None:
            reducer = collectives.StatisticsReducer(ps.get_data_parallel_group())
        plan = normalization.global_plan(cfg, batch, reducer)
    logprob_chunk(cfg.logprob_chunk_size, 0)  # a bad setting fails before the schedule runs
    data, seq_len, mbs = prepare_microbatches(
        batch,
        view,
        cfg.num_microbatches,
        max_tokens=cfg.max_tokens_per_microbatch,
        uniform=ps.get_pipeline_model_parallel_world_size() > 1,
        thd=_use_thd(cfg.thd, cfg.max_tokens_per_microbatch, view),
    )
    dp = ps.get_data_parallel_world_size()
    factor = normalization.scale(
        len(data), dp, view.cp, per_token_loss=bool(config.calculate_per_token_loss)
    )
    share = normalization.part_share(len(data), dp)
    loss_func = _grpo_loss_func(cfg, view, batch, plan, normalization, factor * share, share)
    store = run_schedule(chunks, data, seq_len, mbs, forward_only=False, loss_func=loss_func)
    return _global_result(store, last, reducer)


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


def _grpo_loss_func(cfg, view, batch, plan, normalization, scale: float, share: float):
    """The schedule's loss function: each micro-batch's (and CP shard's) part of the GRPO loss,
    times `scale`, with its additive metrics."""
    with_entropy = cfg.loss.entropy_coef > 0
    one = torch.ones((), dtype=torch.int, device=batch.tokens.device)

    def loss_func(mb, output):
        logp, ent = _logprobs(
            output,
            mb,
            view,
            temperature=cfg.temperature,
            chunk_size=cfg.logprob_chunk_size,
            with_entropy=with_entropy,
        )
        mb_plan = normalization.part_plan(plan, cfg, batch, mb["rows"])
        if "packed_seq_params" in mb:  # THD: [1, total] -> the packed (sequence-index) form
            logp, ent = logp[0], (None if ent is None else ent[0])
        else:
            mb_plan = mb_plan.padded_to(logp.shape[0])  # padding rows (PP's shapes) weigh 0
        part, metrics = grpo_loss(
            logp,
            mb["old"],
            mb["mask"],
            mb_plan,
            cfg.loss,
            ref_logprobs=mb.get("ref"),
            entropy=ent,
            is_weights=mb.get("is"),
        )
        # `part * share` is this micro-batch's (and CP shard's) exact share of the step's loss;
        # `scale` is that share times the factor that cancels megatron-core's scaling
        # (loss_scale.py names the lines in schedules.py, distributed_data_parallel.py and
        # finalize_model_grads.py); num_tokens = 1 per micro-batch makes every divisor
        # megatron-core applies a count known in advance.
        return part * scale, one, _additive(part, metrics, share)

    return loss_func


def loss_plan(cfg: StepConfig, batch: GRPOBatch, rows, reduce) -> LossPlan:
    """The plan of `batch[rows]`'s sequences from their statistics summed by `reduce`: the
    global batch's (rows = all, reduce over DP) or, for the control, one micro-batch's alone."""
    return LossPlan.build(
        cfg.aggregation,
        batch.lengths[rows],
        batch.advantages[rows],
        batch.group_ids[rows],
        reduce=reduce,
        num_groups=cfg.num_groups,
    )


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


@torch.no_grad()
def compute_logprobs(
    chunks: list[torch.nn.Module],
    tokens: torch.Tensor,
    *,
    num_microbatches: int = 1,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    cp_mode: str | None = None,
    explicit_causal_mask: bool | None = None,
    max_tokens_per_microbatch: int | None = None,
    seq_tokens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `tokens` under the model, through the same schedule.

    Returns token-aligned fp32 [N, S] tensors (position 0 is 0: nothing predicts it) on every
    TP, PP and CP rank of this DP rank: the old or reference log-probs of a GRPO step.
    With `max_tokens_per_microbatch`, row i is run on its first `seq_tokens[i]` tokens (default
    all S; pass batching.response_end(response_mask) to skip the right padding) packed into
    token-budget micro-batches; positions past a row's tokens are 0.
    """
    n, s = shape2("tokens", tokens)
    view = _cp_view(cp_mode, explicit_causal_mask)
    check_cp_agreement(chunks, view.mode, view.cp)  # model CP == batch CP sharding, or raise
    ps = _ps()
    logprob_chunk(chunk_size, 0)
    if max_tokens_per_microbatch is not None and seq_tokens is None:
        seq_tokens = [s] * n
    data, seq_len, mbs = prepare_microbatches(
        _tokens_only_batch(tokens),
        view,
        num_microbatches,
        max_tokens=max_tokens_per_microbatch,
        seq_tokens=seq_tokens,
        uniform=ps.get_pipeline_model_parallel_world_size() > 1,
        thd=_use_thd(None, max_tokens_per_microbatch, view),
    )

    def loss_func(mb, output):  # no loss: the log-probs (and entropy) as the micro-batch's metrics
        logp, ent = _logprobs(
            output,
            mb,
            view,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
        res = {"logprobs": logp} if ent is None else {"logprobs": logp, "entropy": ent}
        zero = torch.zeros((), dtype=torch.float32, device=tokens.device)
        return zero, torch.ones((), dtype=torch.int, device=tokens.device), res

    store = run_schedule(chunks, data, seq_len, mbs, forward_only=True, loss_func=loss_func)
    keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    outs = [_token_aligned(store, data, key, tokens) for key in keys]
    return outs[0], (outs[1] if with_entropy else None)


def _tokens_only_batch(tokens: torch.Tensor) -> GRPOBatch:
    """`tokens` as a batch for the schedule: no response, zero advantages and log-probs."""
    n, s = tokens.shape
    dev = tokens.device
    return GRPOBatch(
        tokens,
        torch.zeros_like(tokens, dtype=torch.bool),
        torch.zeros(n, device=dev),
        torch.zeros(n, dtype=torch.long, device=dev),
        torch.zeros(n, s, device=dev),
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
        for mb, d in zip(data, store, strict=True):  # d[key]: [rows, width / CP]
            if "packed_seq_params" in mb:  # THD: [1, total], CP = 1
                thd_scatter(d[key][0].float(), mb, full)
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
