"""The packed (THD) micro-batch's arithmetic against the padded layout (CPU; the THD model
forward itself needs Transformer Engine on a GPU and is not run here)."""

from __future__ import annotations

import pytest
import torch

from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.megatron.batching import CPView, GRPOBatch, prepare_microbatches, response_end
from megatron_ba.megatron.thd import thd_microbatch, thd_scatter

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _batch(seed: int = 0) -> GRPOBatch:
    g = torch.Generator().manual_seed(seed)
    n, s = 4, 12
    prompt = torch.tensor([2, 3, 1, 2])
    resp = torch.tensor([5, 2, 7, 4])
    pos = torch.arange(s)[None]
    end = (prompt + resp)[:, None]
    mask = (pos >= prompt[:, None]) & (pos < end)
    tokens = torch.where(pos < end, torch.randint(1, 50, (n, s), generator=g), 0)
    old = torch.randn(n, s, dtype=torch.float64, generator=g)
    ref = torch.randn(n, s, dtype=torch.float64, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    return GRPOBatch(tokens, mask, adv, torch.tensor([0, 0, 1, 1]), old, ref).checked()


def test_offsets_positions_and_targets():
    b = _batch()
    ends = response_end(b.response_mask)
    assert ends == [7, 5, 8, 6]
    mb = thd_microbatch(b, [1, 3], ends)
    assert mb["cu_seqlens"] == [0, 5, 11]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
    assert mb["input_ids"][0, :5].tolist() == b.tokens[1, :5].tolist()
    # Targets: next token of the same sequence; the last position of each sequence has none.
    assert mb["targets"][0, :5].tolist() == [*b.tokens[1, 1:5].tolist(), 0]
    assert mb["packed_seq_params"].qkv_format == "thd"
    assert mb["packed_seq_params"].cu_seqlens_q.tolist() == [0, 5, 11]
    padded = thd_microbatch(b, [1, 3], ends, total=16)
    assert padded["cu_seqlens"] == [0, 5, 11, 16] and padded["input_ids"].shape == (1, 16)
    assert (padded["mask"][11:] == -1).all()
    with pytest.raises(ValueError, match="cp: packed"):
        thd_microbatch(b, [1], ends, cp=2)


def test_loss_equals_the_padded_layout_in_float64():
    """The same log-probs laid out both ways give the same loss and per-token gradients."""
    b = _batch()
    ends = response_end(b.response_mask)
    rows = [0, 2, 3]
    (pad_mb,), _, _ = prepare_microbatches(
        GRPOBatch(
            b.tokens[rows],
            b.response_mask[rows],
            b.advantages[rows],
            b.group_ids[rows],
            b.old_logprobs[rows].double(),
            b.ref_logprobs[rows].double(),
        ).checked(),
        CPView(),
        1,
        max_tokens=100,
    )
    thd = thd_microbatch(b, rows, ends)
    # Token-aligned log-probs of the whole batch; each layout reads its positions from them.
    lp_tok = torch.randn(4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    width = pad_mb["input_ids"].shape[1]
    lp_pad = torch.zeros(3, width, dtype=torch.float64)
    lp_pad[:, : width - 1] = lp_tok[rows, 1:width]
    lp_thd = torch.zeros(thd["cu_seqlens"][-1], dtype=torch.float64)
    for k, r in enumerate(rows):
        a, t = thd["cu_seqlens"][k], ends[r]
        lp_thd[a : a + t - 1] = lp_tok[r, 1:t]
    plan = LossPlan.build(
        AggregationSettings("balanced"), b.lengths, b.advantages, b.group_ids
    ).select(torch.tensor(rows))
    cfg = GRPOLossConfig(kl_coef=0.1)
    lp_pad.requires_grad_()
    lp_thd.requires_grad_()
    # The old/ref inputs of prepare_microbatches are fp32; use the same values on both sides.
    old_thd, ref_thd = thd["old"].double(), thd["ref"].double()
    l_pad, m_pad = grpo_loss(
        lp_pad,
        pad_mb["old"].double(),
        pad_mb["mask"],
        plan,
        cfg,
        ref_logprobs=pad_mb["ref"].double(),
    )
    l_thd, m_thd = grpo_loss(lp_thd, old_thd, thd["mask"], plan, cfg, ref_logprobs=ref_thd)
    torch.testing.assert_close(l_thd, l_pad, rtol=1e-13, atol=1e-15)
    assert m_thd["num_tokens_sum"] == m_pad["num_tokens_sum"] == b.response_mask[rows].sum()
    (g_pad,) = torch.autograd.grad(l_pad, lp_pad)
    (g_thd,) = torch.autograd.grad(l_thd, lp_thd)
    back = torch.zeros(4, 12, dtype=torch.float64)
    thd_scatter(g_thd, thd, back)
    torch.testing.assert_close(back[rows, 1:width], g_pad[:, : width - 1], rtol=1e-13, atol=0)


def test_scatter_round_trip():
    b = _batch()
    ends = response_end(b.response_mask)
    mb = thd_microbatch(b, [0, 1, 2, 3], ends)
    vals = torch.arange(mb["cu_seqlens"][-1], dtype=torch.float32)
    out = torch.zeros(4, 12)
    thd_scatter(vals, mb, out)
    assert out[1].tolist()[:6] == [0.0, 7.0, 8.0, 9.0, 10.0, 0.0]  # seq 1 starts at 7 (len 7)
