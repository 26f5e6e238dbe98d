"""The contiguous packed apply (`apply_weights_packed(..., counts=)`): exact and sync-free.

Its per-token weight vector (`token_weights`) is built with no host synchronisation: the test
makes every device-to-host read (item, tolist, int/float/bool of a tensor) raise while the apply
runs forward and backward (the Python-loop version this replaced, which read the counts back with
.tolist(), fails it).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ba.aggregation import apply_weights, apply_weights_packed, token_weights

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _pack(lengths: list[int], padding: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, t = len(lengths), max([*lengths, 1])
    padded = torch.randn(n, t, dtype=torch.float64, generator=g)
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    packed = torch.cat([padded[mask], torch.randn(padding, dtype=torch.float64, generator=g)])
    return padded, mask, packed


def test_hand_computed_value_and_gradient():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([0.5, 7.0, 2.0], dtype=torch.float64)
    counts = torch.tensor([2, 0, 3])  # sequence 1 is empty; token 5 is padding
    out = apply_weights_packed(x, None, w, counts=counts)
    assert out.item() == 0.5 * (1 + 2) + 2.0 * (3 + 4 + 5)
    out.backward()
    assert x.grad.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0, 0.0]


@pytest.mark.parametrize("host_counts", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_equals_padded_apply_in_float64(seed, host_counts):
    g = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(0, 9, (7,), generator=g).tolist()
    padded, mask, packed = _pack(lengths, padding=seed * 3, seed=seed)
    w = torch.rand(7, dtype=torch.float64, generator=g)
    padded.requires_grad_()
    packed.requires_grad_()
    ref = apply_weights(padded, mask, w)
    counts = lengths if host_counts else torch.tensor(lengths)
    out = apply_weights_packed(packed, None, w, counts=counts)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    ref.backward()
    out.backward()
    n_live = sum(lengths)
    torch.testing.assert_close(packed.grad[:n_live], padded.grad[mask], rtol=0, atol=0)
    assert torch.equal(packed.grad[n_live:], torch.zeros(seed * 3, dtype=torch.float64))


def test_token_weights_follow_the_values_dtype():
    like = torch.zeros(5, dtype=torch.float32)
    v = token_weights(torch.tensor([1.5, 2.5], dtype=torch.float64), torch.tensor([1, 3]), like)
    assert v.dtype == like.dtype and v.device == like.device
    assert v.tolist() == [1.5, 2.5, 2.5, 2.5, 0.0]


@pytest.mark.parametrize(
    "counts, err, match",
    [
        (torch.tensor([2, -1, 1]), RuntimeError, "counts: must be token counts >= 0"),
        (torch.tensor([3, 3, 3]), RuntimeError, "at most the pack's 6 tokens"),
        (torch.tensor([1, 1]), ValueError, "counts: must be \\[N\\]"),
        (torch.tensor([1.0, 1.0, 1.0]), ValueError, "counts: must be integer"),
        ([3, 3, 3], ValueError, "counts: must be 3 token counts >= 0 summing to at most"),
        ([2, -1, 1], ValueError, "counts: must be 3 token counts"),
        ([1, 1], ValueError, "got 2 summing to 2"),
    ],
)
def test_bad_counts_are_named(counts, err, match):
    with pytest.raises(err, match=match):
        apply_weights_packed(torch.zeros(6), None, torch.ones(3), counts=counts)


@contextlib.contextmanager
def _no_host_reads(monkeypatch):
    """Every way a tensor's value reaches Python raises (on a GPU each would be a sync)."""

    def refuse(name):
        def fn(self, *a, **k):
            raise AssertionError(f"host read in the loss path: Tensor.{name}")

        return fn

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("counts", [torch.tensor([3, 0, 9, 12, 7]), [3, 0, 9, 12, 7]])
def test_contiguous_apply_reads_nothing_back_to_the_host(monkeypatch, counts):
    x = torch.randn(40, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, dtype=torch.float64)
    with _no_host_reads(monkeypatch):
        out = apply_weights_packed(x, None, w, counts=counts)
        out.backward()
    assert x.grad is not None


def test_the_no_host_reads_guard_catches_a_read(monkeypatch):
    """The guard is not vacuous: a .tolist() under it fails."""
    with _no_host_reads(monkeypatch), pytest.raises(AssertionError, match=r"Tensor\.tolist"):
        torch.tensor([1, 2]).tolist()
