"""Token-budget micro-batches, token-balanced DP shards, THD offsets and the log-prob chunking
rule: hand-computed layouts, the budget invariant as a property, and the errors naming the key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.megatron.batching import (
    CPView,
    GRPOBatch,
    logprob_chunk,
    prepare_microbatches,
    response_end,
)
from megatron_ba.megatron.packing import (
    balanced_dp_shards,
    fixed_count_microbatches,
    microbatch_cost,
    thd_cu_seqlens,
    token_budget_microbatches,
)
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.step_settings import AUTO_CHUNK, AUTO_CHUNK_ABOVE


def test_token_budget_hand_computed():
    # Longest first: 9 opens a micro-batch; 9+7 padded = 2 x 9 = 18 > 16, so 7 opens the next;
    # 7, 5 -> 14 <= 16; adding 3 -> 3 x 7 = 21 > 16; 3, 2 -> 6.
    assert token_budget_microbatches([5, 9, 3, 7, 2], 16) == [[1], [0, 3], [2, 4]]
    # Packed (THD) cost is the sum: 9 + 7 = 16 fits, then 5 + 3 + 2 = 10.
    assert token_budget_microbatches([5, 9, 3, 7, 2], 16, cost="packed") == [[1, 3], [0, 2, 4]]
    # CP = 2 rounds every sequence up to a multiple of 4: 5 -> 8, 3 -> 4, 2 -> 4.
    assert token_budget_microbatches([5, 3, 2], 8, multiple=4) == [[0], [1, 2]]


def test_token_budget_errors_name_the_key():
    with pytest.raises(ValueError, match=r"parallel\.max_tokens_per_microbatch: 8 tokens is below"):
        token_budget_microbatches([5, 9], 8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"parallel\.max_tokens_per_microbatch: must be"):
            token_budget_microbatches([1], bad)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    slack=st.integers(0, 60),
    cost=st.sampled_from(["padded", "packed"]),
    multiple=st.sampled_from([1, 2, 4]),
)
def test_token_budget_partitions_within_budget(lengths, slack, cost, multiple):
    rounded = [-(-t // multiple) * multiple for t in lengths]
    budget = max(max(rounded), 1) + slack
    bins = token_budget_microbatches(lengths, budget, cost=cost, multiple=multiple)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # a partition
    assert all(b == sorted(b) and b for b in bins)
    assert all(microbatch_cost([rounded[i] for i in b], cost) <= budget for b in bins)
    assert bins == token_budget_microbatches(lengths, budget, cost=cost, multiple=multiple)


def test_fixed_count_need_not_divide():
    assert fixed_count_microbatches(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="num_microbatches: 6 is more than"):
        fixed_count_microbatches(5, 6)


def test_balanced_dp_shards_hand_computed_and_balanced():
    # LPT: 10 -> r0, 8 -> r1, 6 -> r1 (8 < 10), 5 -> r0 (10 < 14), 1 -> r1 (14 < 15).
    shards = balanced_dp_shards([1, 8, 6, 10, 5], 2)
    loads = [sum([1, 8, 6, 10, 5][i] for i in s) for s in shards]
    assert shards == [[3, 4], [0, 1, 2]] and loads == [15, 15]
    # (Every-dp-th-row sharding of the same lengths gives 1 + 6 + 5 = 12 vs 8 + 10 = 18.)
    with pytest.raises(ValueError, match="dp: 3 ranks need at least 3 sequences"):
        balanced_dp_shards([1, 2], 3)


def test_thd_offsets():
    assert thd_cu_seqlens([3, 5, 1]) == ([0, 3, 8, 9], [0, 3, 8, 9])
    assert thd_cu_seqlens([3, 5, 1], cp=2) == ([0, 3, 8, 9], [0, 4, 12, 16])


def _batch(ends: list[int], s: int = 12) -> GRPOBatch:
    n = len(ends)
    pos = torch.arange(s)[None]
    end = torch.tensor(ends)[:, None]
    mask = (pos >= 1) & (pos < end)
    tokens = torch.where(pos < end, torch.arange(1, s + 1).expand(n, s), torch.zeros(n, s).long())
    return GRPOBatch(
        tokens, mask, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.zeros(n, s)
    ).checked()


def test_budget_microbatches_are_cut_to_their_longest():
    b = _batch([10, 3, 4, 9])
    assert response_end(b.response_mask) == [10, 3, 4, 9]
    data, _, _ = prepare_microbatches(b, CPView(), 1, max_tokens=20)
    # 10 and 9 share 2 x 10 = 20 tokens; 4 and 3: 2 x 4 = 8.
    assert [mb["rows"].tolist() for mb in data] == [[0, 3], [1, 2]]
    assert [tuple(mb["input_ids"].shape) for mb in data] == [(2, 10), (2, 4)]
    assert all(mb["mask"].sum() == b.response_mask[mb["rows"]].sum() for mb in data)


def test_uniform_pads_rows_and_width_with_masked_rows():
    b = _batch([10, 3, 4, 9, 2])
    data, seq_len, mbs = prepare_microbatches(b, CPView(), 1, max_tokens=20, uniform=True)
    # Planned as five sequences of 10 tokens: [[0, 1], [2, 3], [4]], each padded to 2 x 10.
    assert (seq_len, mbs) == (10, 2)
    assert [mb["rows"].tolist() for mb in data] == [[0, 1], [2, 3], [4]]
    assert all(tuple(mb["input_ids"].shape) == (2, 10) for mb in data)
    assert data[2]["num_rows"] == 1 and not data[2]["mask"][1].any()


def test_logprob_chunk_rule():
    assert logprob_chunk(None, AUTO_CHUNK_ABOVE) is None
    assert logprob_chunk(None, AUTO_CHUNK_ABOVE + 1) == AUTO_CHUNK
    assert logprob_chunk(7, 10) == 7
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"parallel\.logprob_chunk_size: must be"):
            logprob_chunk(bad, 10)


def test_auto_chunked_equals_unchunked_above_the_threshold():
    g = torch.Generator().manual_seed(0)
    t = AUTO_CHUNK_ABOVE + 3  # auto picks a chunk here
    logits = torch.randn(1, t, 5, generator=g, requires_grad=True)
    targets = torch.randint(0, 5, (1, t), generator=g)
    chunk = logprob_chunk(None, targets.numel())
    assert chunk is not None
    outs = []
    for c in (None, chunk):
        lp, h = vocab_parallel_logprobs(logits, targets, chunk_size=c, with_entropy=True)
        (grad,) = torch.autograd.grad((lp * 0.7 + h * 0.3).sum(), logits)
        outs.append((lp, h, grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32 chunk buffers
