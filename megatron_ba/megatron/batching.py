"""A GRPO batch laid out for megatron-core's schedules: micro-batches, CP shards, label alignment.

    parts = schedule_microbatches(batch, MicroBatchSpec(num_microbatches=4))   # on every rank
    store = run_schedule(chunks, parts, forward_only=False, loss_func=...)

The batch is a GRPOBatch (megatron_ba.megatron.grpo_batch, re-exported here). `MicroBatchSpec`
is how a rank's batch is split (micro-batches or a token budget, where CP is
applied, packed or padded, log-softmax chunks); `schedule_microbatches` resolves it against the
parallel state and returns finished micro-batches: each holds the model's inputs and the loss's
inputs in the form the loss reads them (`mask`'s shape is the loss's, `plan_rows` how many
per-sequence weights it takes), so the step never branches on the layout.

The public tensors are token-aligned (`logprobs[i, t]` is about `tokens[i, t]`); a causal LM's
output at position p predicts token p + 1, so the loss inputs are shifted to be position-aligned
before they are cut into micro-batches (rows) and context-parallel shards (positions, megatron-
core's load-balanced layout: megatron_ba.parallel.sharding). Sequences are right-padded to a
multiple of 2 x CP; the padding is masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron_ba.errors import SettingError
from megatron_ba.megatron import routing_replay
from megatron_ba.megatron.grpo_batch import (  # re-exported: the batch and its rows
    GRPOBatch as GRPOBatch,
)
from megatron_ba.megatron.grpo_batch import (
    label_aligned as label_aligned,
)
from megatron_ba.megatron.grpo_batch import (
    pad_to as pad_to,
)
from megatron_ba.megatron.grpo_batch import (
    response_end as response_end,
)
from megatron_ba.megatron.grpo_batch import (
    shape2 as shape2,
)
from megatron_ba.megatron.packing import fixed_count_microbatches, token_budget_microbatches
from megatron_ba.megatron.thd import thd_microbatch
from megatron_ba.parallel.sharding import cp_shard
from megatron_ba.step_settings import MicroBatching

CP_MODES = ("model", "loss")


@dataclass(frozen=True)
class CPView:
    """How this rank sees sequences: CP size and rank, and where CP is applied."""

    cp: int = 1
    rank: int = 0
    mode: str = "loss"  # "model": the model gets CP shards; "loss": whole sequences, shard logits
    causal_mask: bool = True  # pass an explicit causal mask (local attention, whole sequences)
    # Sequence parallelism splits each CP shard's positions over this many TP ranks (1: off).
    sequence_split: int = 1

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return cp_shard(x, cp=self.cp, rank=self.rank, dim=1)

    @property
    def length_multiple(self) -> int:
        """What a micro-batch's width must be a multiple of: 2 x cp (CP's load-balanced halves)
        times the sequence-parallel split (megatron-core scatters the positions over TP)."""
        return (2 * self.cp if self.cp > 1 else 1) * self.sequence_split

    def padded_length(self, s: int) -> int:
        m = self.length_multiple
        return -(-s // m) * m

    def logits_for_loss(self, output: torch.Tensor) -> torch.Tensor:
        # GPTModel returns [b, s, V/TP] when no labels are given; in "loss" mode s is the whole
        # sequence and this rank keeps its CP positions.
        return self.shard(output) if self.mode == "loss" else output


@dataclass(frozen=True)
class MicroBatchSpec:
    """How a rank's batch is split for the schedule (the recipe's parallel section)."""

    num_microbatches: int = 1  # per DP rank (need not divide its sequences); see max_tokens
    # parallel.max_tokens_per_microbatch: pack each micro-batch up to this many tokens (rows x
    # longest, see prepare_microbatches) instead of num_microbatches equal parts.
    max_tokens_per_microbatch: int | None = None
    # parallel.logprob_chunk_size: tokens per chunk of the vocab-parallel log-softmax; None:
    # auto (chunked above AUTO_CHUNK_ABOVE tokens per micro-batch, see logprob_chunk).
    logprob_chunk_size: int | None = None
    # "model": the model runs CP attention (Transformer Engine, GPUs) on the load-balanced shards;
    # "loss" (default without CUDA): megatron-core's attention cannot run CP on CPU, so the model
    # sees whole sequences and the logits are sharded the same way before the loss (build the
    # model with model.model_pg_collection_without_cp()).
    cp_mode: str | None = None
    explicit_causal_mask: bool | None = None  # default: True without CUDA (local attention)
    # Packed (THD) micro-batches under a token budget: None = auto (CUDA, cp_mode "model");
    # needs Transformer Engine attention (megatron_ba.megatron.thd; status: docs/status.md).
    thd: bool | None = None


@dataclass(frozen=True)
class MicroBatches:
    """Finished micro-batches and the shapes megatron-core's schedule announces."""

    parts: list[dict]
    seq_length: int  # the pipeline schedules' p2p shape (see prepare_microbatches)
    micro_batch_size: int
    view: CPView
    logprob_chunk_size: int | None = None  # the spec's setting (logprob_chunk resolves it)

    def __len__(self) -> int:
        return len(self.parts)


def logprob_chunk(setting: int | None, num_tokens: int) -> int | None:
    """The chunk size of a micro-batch's log-softmax: step_settings.MicroBatching's rule for
    `setting` (parallel.logprob_chunk_size; None: auto); a bad one names the recipe key."""
    try:
        return MicroBatching(logprob_chunk_size=setting).logprob_chunk(num_tokens)
    except SettingError as e:
        raise ValueError(e.renamed(prefix="parallel.")) from None


def cp_view(spec: MicroBatchSpec, sequence_parallel: bool = False) -> CPView:
    """This rank's CPView under `spec` (the parallel state's CP size and rank); with
    `sequence_parallel` (the model's config) the TP ranks split each micro-batch's positions."""
    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    mode = spec.cp_mode or ("model" if cuda else "loss")
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode: unknown value {mode!r}; expected one of {', '.join(CP_MODES)}")
    mask = (not cuda) if spec.explicit_causal_mask is None else spec.explicit_causal_mask
    cp = ps.get_context_parallel_world_size()
    if mask and mode == "model" and cp > 1:
        raise ValueError("explicit_causal_mask: a whole-sequence mask cannot go with CP shards")
    split = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    return CPView(
        cp=cp,
        rank=ps.get_context_parallel_rank(),
        mode=mode,
        causal_mask=mask,
        sequence_split=split,
    )


def _use_thd(spec: MicroBatchSpec, view: CPView) -> bool:
    """Packed (THD) micro-batches: only under a token budget; auto = CUDA with CP in the model."""
    if spec.max_tokens_per_microbatch is None:
        return False
    if spec.thd is None:
        return torch.cuda.is_available() and view.mode == "model" and view.cp == 1
    return bool(spec.thd)


def schedule_microbatches(
    batch: GRPOBatch,
    spec: MicroBatchSpec,
    *,
    seq_tokens: list[int] | None = None,
    sequence_parallel: bool = False,
) -> MicroBatches:
    """`batch` cut as `spec` says for this rank (after `initialize_model_parallel`): CP view,
    pipeline-uniform shapes, packed or padded, all resolved here (prepare_microbatches).
    `sequence_parallel`: the model's config says the TP ranks split the positions (widths are
    then padded to a multiple of tp, as megatron-core's scatter needs)."""
    from megatron.core import parallel_state as ps

    view = cp_view(spec, sequence_parallel)
    logprob_chunk(spec.logprob_chunk_size, 0)  # a bad setting fails before the schedule runs
    parts, seq_length, mbs = prepare_microbatches(
        batch,
        view,
        spec.num_microbatches,
        max_tokens=spec.max_tokens_per_microbatch,
        seq_tokens=seq_tokens,
        uniform=ps.get_pipeline_model_parallel_world_size() > 1,
        thd=_use_thd(spec, view),
    )
    return MicroBatches(parts, seq_length, mbs, view, spec.logprob_chunk_size)


def causal_mask(s: int, *, valid: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """The attention mask of a causal LM over `s` positions, True where attention is cut.

    [1, 1, s, s] (key k > query q is masked); with `valid` ([B, s] bool, False at padding) the
    padded keys are masked too: [B, 1, s, s] (left-padded prompts, generation).
    """
    if valid is not None and (valid.dim() != 2 or valid.shape[1] != s):
        raise ValueError(
            f"valid: must be [B, {s}] (one flag per position), got {tuple(valid.shape)}"
        )
    device = valid.device if device is None and valid is not None else device
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]
    return mask if valid is None else mask | ~valid.bool()[:, None, None, :]


def model_inputs(tokens: torch.Tensor, view: CPView):
    """(input_ids, position_ids, attention_mask) for whole [b, S_pad] tokens."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).expand(b, s)
    if view.mode == "model":
        tokens, positions = view.shard(tokens), view.shard(positions)
    attn = None
    if view.causal_mask:  # True = masked out; whole sequences only (local attention)
        attn = causal_mask(s, device=tokens.device)
    return tokens, positions.contiguous(), attn


def prepare_microbatches(
    batch: GRPOBatch,
    view: CPView,
    num_microbatches: int,
    *,
    max_tokens: int | None = None,
    seq_tokens: list[int] | None = None,
    uniform: bool = False,
    thd: bool = False,
) -> tuple[list[dict], int, int]:
    """(micro-batch dicts, seq_length, micro_batch_size) for the schedule.

    Each dict holds the model inputs and this CP rank's position-aligned loss inputs: `targets`,
    `mask`, `old` (and `ref`), plus `rows` (its sequences' indices in the batch, for
    LossPlan.select), `num_rows` (how many of its rows are real; the rest are `uniform`
    padding rows, all masked) and `plan_rows` (the rows the loss weighs, padding included: the
    plan of `rows` is padded with zero weights up to it).

    `max_tokens` None: `num_microbatches` contiguous micro-batches of whole [*, S] rows (sizes
    differ by at most one). Else the token budget (parallel.max_tokens_per_microbatch): the
    sequences are packed by packing.token_budget_microbatches (`seq_tokens[i]` tokens each,
    default `response_end`) and each micro-batch is cut to its longest sequence (rounded up to a
    multiple of 2 x CP); `num_microbatches` is then ignored.

    `uniform` (pipeline parallelism): megatron-core's pipeline schedules send every micro-batch's
    activations with one shape (seq_length, micro_batch_size), so all micro-batches are padded
    to the longest and the largest (under a budget, packed as if every sequence were the
    longest, so the padded micro-batches stay within it); every stage of a model replica gets
    the same batch and plans the same layout, so they agree on the number and the shapes
    without communicating.

    `thd` (with `max_tokens`; CUDA + Transformer Engine): packed micro-batches instead, one
    [1, total] row each with PackedSeqParams and the budget bounding the sum of the sequences'
    tokens (megatron_ba.megatron.thd; what has run where: docs/status.md).
    """
    if batch.routed_experts is not None:
        routing_replay.check_replayable(thd=thd, cp_sharded=view.mode == "model" and view.cp > 1)
    if thd:  # GPU (Transformer Engine) only: see megatron_ba.megatron.thd
        return _thd_microbatches(batch, view, max_tokens, seq_tokens, uniform)
    groups, widths = _row_groups(batch, view, num_microbatches, max_tokens, seq_tokens, uniform)
    rows_per = [len(g) for g in groups]
    if uniform:
        widths = [max(widths)] * len(groups)
        rows_per = [max(rows_per)] * len(groups)
    data = [
        _microbatch(batch, view, g, width, b)
        for g, width, b in zip(groups, widths, rows_per, strict=True)
    ]
    # The schedule's p2p shape is (seq_length // CP, mbs, hidden) (schedules.get_tensor_shapes):
    # in "loss" mode the activations are whole sequences, so announce S_pad x CP. Only the
    # pipeline schedules read it, and there every micro-batch has this shape (`uniform`).
    seq_len = max(widths) * view.cp if view.mode == "loss" else max(widths)
    return data, seq_len, max(rows_per)


def _row_groups(batch: GRPOBatch, view: CPView, num_microbatches, max_tokens, seq_tokens, uniform):
    """(each micro-batch's rows, its width padded for the CP view): prepare_microbatches'
    fixed count, or its token budget."""
    n, s = batch.tokens.shape
    if max_tokens is None:
        groups = fixed_count_microbatches(n, num_microbatches)
        widths = [s] * len(groups)
    else:
        if seq_tokens is None:
            seq_tokens = response_end(batch.response_mask)
        if len(seq_tokens) != n:
            raise ValueError(
                f"seq_tokens: must have one entry per row ({n}), got {len(seq_tokens)}"
            )
        # Uniform shapes make every micro-batch as wide as the longest sequence: plan with that
        # width for all, so that rows x width stays within the budget after the padding.
        plan = [max(seq_tokens)] * n if uniform else seq_tokens
        multiple = view.length_multiple
        groups = token_budget_microbatches(plan, max_tokens, cost="padded", multiple=multiple)
        widths = [max(seq_tokens[i] for i in g) for g in groups]
    return groups, [view.padded_length(w) for w in widths]


def _microbatch(batch: GRPOBatch, view: CPView, g: list[int], width: int, b: int) -> dict:
    """One micro-batch of rows `g`, `width` positions, `b` rows (padding rows past len(g))."""
    s = batch.tokens.shape[1]
    rows = torch.tensor(g, dtype=torch.long, device=batch.tokens.device)
    # Padding rows (uniform only) repeat row g[0] with an all-False mask: they run through the
    # model like any row and add exactly 0 to the loss and its gradient.
    idx = torch.cat([rows, rows[:1].expand(b - len(g))])
    live = (torch.arange(b, device=rows.device) < len(g))[:, None]
    tokens = pad_to(batch.tokens[idx].long(), max(width, s), 0)[:, :width]
    mask = pad_to(batch.response_mask[idx], max(width, s), False)[:, :width] & live
    per_pos = {
        "targets": label_aligned(tokens, 0),
        "mask": label_aligned(mask, False),
        "old": label_aligned(_cut(batch.old_logprobs[idx].float(), width, s), 0.0),
    }
    if batch.ref_logprobs is not None:
        per_pos["ref"] = label_aligned(_cut(batch.ref_logprobs[idx].float(), width, s), 0.0)
    if batch.is_weights is not None:
        per_pos["is"] = label_aligned(_cut(batch.is_weights[idx].float(), width, s), 0.0)
    ids, pos, attn = model_inputs(tokens, view)
    mb = {"input_ids": ids, "position_ids": pos, "attention_mask": attn}
    mb.update({k: view.shard(v) for k, v in per_pos.items()})
    mb.update(rows=rows, num_rows=len(g), plan_rows=b, width=width)
    if batch.routed_experts is not None:
        mb["routing"] = routing_replay.microbatch_routing(batch.routed_experts[idx], width)
    return mb


def _thd_microbatches(batch, view: CPView, max_tokens, seq_tokens, uniform: bool):
    if max_tokens is None:
        raise ValueError("thd: packed micro-batches need a token budget (max_tokens)")
    if seq_tokens is None:
        seq_tokens = response_end(batch.response_mask)
    groups = token_budget_microbatches(seq_tokens, max_tokens, cost="packed")
    totals = [sum(seq_tokens[i] for i in g) for g in groups]
    total = max(totals) if uniform else None
    data = [thd_microbatch(batch, g, seq_tokens, cp=view.cp, total=total) for g in groups]
    # PP's p2p shape: (total tokens, 1 row); only read by the pipeline schedules (`uniform`).
    return data, max(totals), 1


def _cut(x: torch.Tensor, width: int, s: int) -> torch.Tensor:
    """Columns [0, width) of [b, s] x, zero-padded on the right when width > s."""
    return pad_to(x, max(width, s), 0.0)[:, :width]


def run_schedule(chunks, parts: MicroBatches, *, forward_only: bool, loss_func, differ=None):
    """megatron-core's get_forward_backward_func() over `parts`; loss_func(mb, output). A
    micro-batch holding `routing` is run with its experts replayed (routing_replay.replaying;
    `differ` collects where the routers' own choice differs)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if any("packed_seq_params" in mb for mb in parts.parts):
        check_packable(chunks)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        extra = {"packed_seq_params": mb["packed_seq_params"]} if "packed_seq_params" in mb else {}
        with routing_replay.replaying(model, mb.get("routing"), differ):
            out = model(mb["input_ids"], mb["position_ids"], mb["attention_mask"], **extra)
        return out, partial(loss_func, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(parts.parts),
        model=chunks,
        num_microbatches=len(parts),
        seq_length=parts.seq_length,
        micro_batch_size=parts.micro_batch_size,
        forward_only=forward_only,
    )


def check_packable(chunks) -> None:
    """ValueError naming parallel.max_tokens_per_microbatch for packed (THD) micro-batches
    through Gated DeltaNet layers (Qwen3.5): megatron-core 0.16.1's GatedDeltaNet raises
    NotImplementedError on packed_seq_params and ignores the attention mask, so its conv1d and
    recurrent state would run from one packed sequence into the next. Padded micro-batches are
    right-padded (prompt at position 0), which causality keeps out of every real token."""
    if any(type(m).__name__ == "GatedDeltaNet" for c in chunks for m in c.modules()):
        raise ValueError(
            "parallel.max_tokens_per_microbatch: packed (THD) micro-batches cannot run through "
            "Gated DeltaNet layers (megatron-core's GatedDeltaNet has no packed-sequence support "
            "and would carry its state across sequences); use padded micro-batches (thd off)"
        )
