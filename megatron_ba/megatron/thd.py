"""Packed (THD) micro-batches: a token-budget micro-batch as one concatenated row for GPUs.

With Transformer Engine attention, megatron-core runs a micro-batch of several sequences as one
[1, total] row plus `PackedSeqParams(qkv_format="thd", cu_seqlens_*)`: no padding to the longest
sequence, attention kept inside each sequence by the offsets. This module builds that form and
its loss inputs from the same GRPOBatch rows batching.prepare_microbatches would put in a padded
micro-batch:

    mb = thd_microbatch(batch, rows, seq_tokens)      # model inputs + packed loss inputs
    logp = ...model(..., packed_seq_params=mb["packed_seq_params"])...   # [1, total]
    grpo_loss(logp[0], mb["old"], mb["mask"], plan.select(mb["rows"]))   # sequence-index form

The loss inputs are 1-D over the pack; `mask` is the sequence index form of
aggregation.apply_weights (local sequence k for a response target, -1 elsewhere), so the plan's
weights apply unchanged. Position p of a sequence predicts its token p + 1; each sequence's last
position predicts nothing.

The arithmetic (offsets, positions, targets, masks, scatter back to [N, S]) is tested on CPU
against the padded layout (tests/test_thd.py); the model forward with THD needs Transformer
Engine on a GPU (what has run where: docs/status.md). CP > 1 is refused: TE's load-balanced THD
split (thd_get_partitioned_indices) is not built.
"""

from __future__ import annotations

import itertools

import torch

from megatron_ba.megatron.packing import thd_cu_seqlens


def thd_microbatch(
    batch, rows: list[int], seq_tokens: list[int], *, cp: int = 1, total: int | None = None
) -> dict:
    """The THD micro-batch of `batch`'s `rows` (sequence k has seq_tokens[rows[k]] tokens).

    `total` (pipeline parallelism's uniform shape): pad the pack to this many tokens with one
    trailing padding sequence (masked), so every micro-batch has the same [1, total] shape.
    """
    if cp != 1:
        raise ValueError(
            f"cp: packed (THD) micro-batches with context parallelism ({cp}) need Transformer "
            "Engine's THD CP split, which is not built; use the padded layout"
        )
    lengths = [int(seq_tokens[i]) for i in rows]
    cu, _ = thd_cu_seqlens(lengths)
    n_tok = cu[-1]
    if total is not None:
        if total < n_tok:
            raise ValueError(f"total: {total} is below the pack's {n_tok} tokens")
        if total > n_tok:
            cu = [*cu, total]  # the padding tail as one more (masked) sequence
    width = cu[-1]
    dev = batch.tokens.device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    seq = torch.cat(
        [torch.full((t,), k, dtype=torch.long, device=dev) for k, t in enumerate(lengths)]
        + [torch.full((width - n_tok,), -1, dtype=torch.long, device=dev)]
    )
    pos = torch.cat(
        [torch.arange(t, device=dev) for t in lengths] + [torch.arange(width - n_tok, device=dev)]
    )
    live = seq >= 0
    src_row, src_pos = idx[seq.clamp(min=0)], pos
    # The target of position p is token p + 1 of the same sequence (none for its last token).
    has_next = live & (pos + 1 < torch.tensor([*lengths, 0], device=dev)[seq.clamp(min=0)])
    nxt = (src_pos + 1).clamp(max=batch.tokens.shape[1] - 1)
    zero = torch.zeros((), device=dev)
    tokens = torch.where(live, batch.tokens[src_row, src_pos].long(), 0)
    targets = torch.where(has_next, batch.tokens[src_row, nxt].long(), 0)
    resp = has_next & batch.response_mask[src_row, nxt].bool()
    mb = {
        "input_ids": tokens[None],
        "position_ids": pos[None],
        "attention_mask": None,
        "packed_seq_params": packed_seq_params(cu, dev),
        "targets": targets[None],
        "mask": torch.where(resp, seq, torch.full_like(seq, -1)),
        "old": torch.where(has_next, batch.old_logprobs[src_row, nxt].float(), zero),
        "rows": idx,
        "num_rows": len(rows),
        "plan_rows": len(rows),  # the mask holds local sequence indices: one weight each
        "row_list": list(rows),
        "cu_seqlens": cu,
        "lengths": lengths,
    }
    if batch.ref_logprobs is not None:
        mb["ref"] = torch.where(has_next, batch.ref_logprobs[src_row, nxt].float(), zero)
    if batch.is_weights is not None:
        mb["is"] = torch.where(has_next, batch.is_weights[src_row, nxt].float(), zero)
    return mb


def packed_seq_params(cu: list[int], device):
    """megatron-core's PackedSeqParams for offsets `cu` (int32, on the batch's device)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        cu_seqlens_q_padded=t,
        cu_seqlens_kv_padded=t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def thd_scatter(values: torch.Tensor, mb: dict, out: torch.Tensor) -> None:
    """Write a pack's position-aligned [total] values into token-aligned out[rows] ([N, S]):
    position p of sequence k is about its token p + 1."""
    s = out.shape[1]
    for k, (row, t) in enumerate(zip(mb["row_list"], mb["lengths"], strict=True)):
        a = mb["cu_seqlens"][k]
        w = min(t - 1, s - 1)
        if w > 0:
            out[row, 1 : 1 + w] = values[a : a + w].to(out.dtype)
