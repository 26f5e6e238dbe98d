"""`megatron-ba perf aggregation`: its token-mean GRPO loss is what grpo_loss computes under the
token rule (so the two rules it times compute the same kind of thing), and it prints the ratio
(figures: docs/performance.md)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_ba.cli import main
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.perf.aggregation_perf import token_mean_grpo_loss


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_token_mean_baseline_is_grpo_loss_under_the_token_rule(dual_clip):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 1, 5, 4, 2, 6])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = torch.tensor([1.2, -0.3, -0.9, 0.0, 0.7, -0.7], dtype=torch.float64)
    index = torch.cat([torch.full((int(t),), i) for i, t in enumerate(lengths)])
    index = torch.cat([index, torch.tensor([-1, -1])])  # padding at the tail
    x = (-torch.rand(index.numel(), generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = x.detach() + torch.randn(index.numel(), generator=g, dtype=torch.float64)
    cfg = GRPOLossConfig(dual_clip=dual_clip)
    want, want_m = grpo_loss(
        x,
        old,
        index,
        LossPlan.build(AggregationSettings("token", scope="batch"), lengths, adv, ids),
        cfg,
    )
    got, got_m = token_mean_grpo_loss(x, old, index, adv, cfg)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    (g_want,) = torch.autograd.grad(want, x)
    (g_got,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(g_got, g_want, rtol=1e-13, atol=1e-15)
    assert set(got_m) == set(want_m)
    for key, value in want_m.items():
        torch.testing.assert_close(got_m[key], value, rtol=1e-13, atol=1e-15, msg=key)
    assert float(want_m["clip_low_frac"]) > 0 and float(want_m["clip_high_frac"]) > 0


def test_bench_aggregation_prints_the_grpo_loss_ratio(capsys):
    argv = "perf aggregation --sequences 32 --max-length 16 --repeats 2 --threads 1".split()
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(
        re.fullmatch(r"packed grpo loss balanced / token-mean = \d+\.\d{3} x", line)
        for line in lines
    ), lines
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # The medians are printed to 0.01 ms (each within 0.005 ms of the one the ratio was taken
    # of) and the ratio to 0.001: the printed ratio lies within what those roundings allow.
    a, b = (r["median_ms"][f"packed/grpo-loss-{rule}"] for rule in ("balanced", "token-mean"))
    assert b > 0.005
    assert (
        (a - 0.005) / (b + 0.005) - 0.0005
        <= r["ratio_grpo_loss"]
        <= (a + 0.005) / (b - 0.005) + 0.0005
    )
