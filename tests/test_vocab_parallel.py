"""Vocab-parallel log-probs and entropy against full-vocabulary torch in float64.

    python -m pytest tests/test_vocab_parallel.py

Single-process checks (TP=1) run in this process; the TP=2 and TP=4 checks run in one launch of
four gloo processes (two TP=2 groups and one TP=4 group), each comparing its results and the
gathered shard gradients with the float64 reference, plus megatron-core's own
`vocab_parallel_cross_entropy` as a check of the shard convention.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs

TOL32 = 2e-5  # fp32 arithmetic against a float64 reference, relative to max(1, |reference|)


def fp32_tolerance(logits: torch.Tensor, temperature: float) -> float:
    """TOL32, or float32's own floor where that is larger: a log-softmax of z / T in float32
    is off by about eps x max |z / T| (the max-shifted logits' rounding), a gradient through it
    by 1 / T more; 4 of those cover the few operations that compound it (exp, sum, log). Large
    logits at a low temperature (12 x 4 = 48 per unit of z) reach it; a wrong formula is off by
    far more."""
    z = float(logits.abs().max()) / temperature if logits.numel() else 0.0
    floor = torch.finfo(torch.float32).eps * max(1.0, z) * max(1.0, 1.0 / temperature)
    return max(TOL32, 4 * floor)


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(1, max |b|): one number every comparison here uses."""
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def upstream(shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, non-uniform upstream gradients for logprobs and entropy (same on every rank)."""
    n = int(torch.Size(shape).numel())
    w_lp = torch.linspace(-1.5, 1.0, n, dtype=torch.float64).view(shape)
    w_h = torch.linspace(0.7, -2.0, n, dtype=torch.float64).view(shape)
    return w_lp, w_h


def reference(logits, targets, temperature=1.0, use=("lp", "h")):
    """float64 full-vocabulary log_softmax / entropy and the gradient of the test's loss."""
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    h = -(logp.exp() * logp).sum(-1)
    w_lp, w_h = upstream(lp.shape)
    loss = ("lp" in use) * (w_lp * lp).sum() + ("h" in use) * (w_h * h).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return lp, h, grad


def ours(shard, targets, use=("lp", "h"), **kw):
    """Values and the shard gradient of the same loss through vocab_parallel_logprobs."""
    x = shard.detach().clone().requires_grad_()
    lp, h = vocab_parallel_logprobs(x, targets, with_entropy=True, **kw)
    w_lp, w_h = upstream(lp.shape)
    loss = 0.0
    if "lp" in use:
        loss = loss + (w_lp.float() * lp).sum()
    if "h" in use:
        loss = loss + (w_h.float() * h).sum()
    loss.backward()
    return lp, h, x.grad


def make_case(seed, lead, vocab, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab, lead, generator=g)
    return logits, targets


# --- TP = 1 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_hand_computed_three_token_vocab(chunk_size):
    # p = (1, 2, 3) / 6: logprob of id 2 is log(1/2); entropy -sum p log p
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]))
    lp, h = vocab_parallel_logprobs(
        logits, torch.tensor([2, 0]), chunk_size=chunk_size, with_entropy=True
    )
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) / 6
    want_h = float(-(p * p.log()).sum())
    assert lp.dtype == h.dtype == torch.float32
    want_lp = torch.tensor([math.log(1 / 2), math.log(1 / 3)], dtype=torch.float64)
    assert torch.allclose(lp.double(), want_lp, atol=1e-6, rtol=0)
    want_h = torch.tensor([want_h, math.log(3)], dtype=torch.float64)
    assert torch.allclose(h.double(), want_h, atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    vocab=st.integers(1, 40),
    scale=st.floats(0.0, 12.0),
    temperature=st.sampled_from([1.0, 0.25, 0.7, 2.5]),
    chunk_size=st.sampled_from([None, 1, 3, 7, 1000]),
    use=st.sampled_from([("lp", "h"), ("lp",), ("h",)]),
)
def test_matches_float64_reference(seed, lead, vocab, scale, temperature, chunk_size, use):
    logits, targets = make_case(seed, lead, vocab, scale)
    r_lp, r_h, r_grad = reference(logits, targets, temperature, use)
    lp, h, grad = ours(logits, targets, use, temperature=temperature, chunk_size=chunk_size)
    tol = fp32_tolerance(logits, temperature)
    assert lp.shape == h.shape == targets.shape and lp.dtype == torch.float32
    assert rel_err(lp, r_lp) < tol
    assert rel_err(h, r_h) < tol
    assert grad.dtype == logits.dtype and rel_err(grad, r_grad) < tol


def test_the_shrunk_float32_case_is_within_its_floor_and_a_wrong_gradient_is_not():
    """The example a search found over TOL32 (entropy only, logits of scale 11 at T 0.25): its
    gradient is 2.4e-5 off float64, within fp32_tolerance; the same gradient at T 0.5 instead
    of 0.25 (a wrong temperature) is far outside it."""
    logits, targets = make_case(0, [4], 25, 11.0)
    _, _, r_grad = reference(logits, targets, 0.25, ("h",))
    _, _, grad = ours(logits, targets, ("h",), temperature=0.25, chunk_size=1)
    assert TOL32 < rel_err(grad, r_grad) < fp32_tolerance(logits, 0.25)
    _, _, wrong = ours(logits, targets, ("h",), temperature=0.5, chunk_size=1)
    assert rel_err(wrong, r_grad) > 100 * fp32_tolerance(logits, 0.25)


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_accuracy_at_a_real_vocab_shard_size(chunk_size):
    # sums over ~19k entries: sloppy fp32 accumulation (e.g. torch.bmm for sum p x) shows here
    logits, targets = make_case(7, (24,), 18992, scale=2.0, dtype=torch.bfloat16)
    r_lp, r_h, _ = reference(logits, targets)
    lp, h = vocab_parallel_logprobs(logits, targets, chunk_size=chunk_size, with_entropy=True)
    assert rel_err(lp, r_lp) < 1e-6 and rel_err(h, r_h) < 1e-6


@pytest.mark.parametrize("use", [("lp", "h"), ("lp",), ("h",)])
def test_chunked_equals_unchunked(use):
    logits, targets = make_case(1, (3, 13), 29, scale=4.0)  # 39 tokens
    base = ours(logits, targets, use, temperature=0.8)
    for chunk in (1, 5, 8, 39, 64):  # 5 and 8 do not divide 39
        got = ours(logits, targets, use, temperature=0.8, chunk_size=chunk)
        for a, b in zip(got, base, strict=True):
            assert rel_err(a, b) < 2e-6, chunk


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logprobs_only_and_empty(chunk_size):
    logits, targets = make_case(2, (2, 9), 17)
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprobs(x, targets, chunk_size=chunk_size, temperature=1.3)
    (lp * upstream(lp.shape)[0].float()).sum().backward()
    r_lp, _, r_grad = reference(logits, targets, 1.3, use=("lp",))
    assert isinstance(lp, torch.Tensor) and rel_err(lp, r_lp) < TOL32
    assert rel_err(x.grad, r_grad) < TOL32
    empty = vocab_parallel_logprobs(
        torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), chunk_size=chunk_size
    )
    assert empty.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [None, 6])
def test_low_precision_inputs_compute_in_fp32(dtype, chunk_size):
    logits, targets = make_case(3, (4, 8), 50, dtype=dtype)
    # reference on the very same (rounded) values: the only difference left is fp32 arithmetic
    r_lp, r_h, r_grad = reference(logits, targets, 0.9)
    lp, h, grad = ours(logits, targets, temperature=0.9, chunk_size=chunk_size)
    assert lp.dtype == h.dtype == torch.float32 and grad.dtype == dtype
    assert rel_err(lp, r_lp) < TOL32 and rel_err(h, r_h) < TOL32
    assert rel_err(grad, r_grad) < 1e-2  # the gradient is returned in the logits' dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_input_not_modified(dtype, chunk_size):
    logits, targets = make_case(4, (2, 5), 12, dtype=dtype)
    x = logits.clone().requires_grad_()
    lp, h = vocab_parallel_logprobs(
        x, targets, temperature=0.5, chunk_size=chunk_size, with_entropy=True
    )
    (lp.sum() + h.sum()).backward()
    assert torch.equal(x.detach(), logits)


def test_chunked_path_saves_only_inputs_and_per_token_statistics():
    t, v = 64, 300
    logits, targets = make_case(5, (t,), v)
    saved: dict[str, int] = {}

    def count(name):
        def pack(tensor):
            if tensor.data_ptr() != x.data_ptr():  # the logits themselves cost nothing extra
                saved[name] = saved.get(name, 0) + tensor.numel() * tensor.element_size()
            return tensor

        return pack

    for name, chunk in (("chunked", 8), ("unchunked", None)):
        x = logits.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(count(name), lambda tensor: tensor):
            lp, h = vocab_parallel_logprobs(x, targets, chunk_size=chunk, with_entropy=True)
        (lp.sum() + h.sum()).backward()
    assert saved["chunked"] <= 64 * t  # O(T): targets, mask, lse, entropy
    assert saved["unchunked"] >= 2 * 4 * t * v  # control: the hook does see [T, V] fp32 saves


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits": torch.zeros(2, 3, dtype=torch.long)}, "logits: must be a floating-point"),
        ({"logits": torch.zeros(2, 0)}, "logits: need a last"),
        ({"targets": torch.zeros(2, 3)}, "targets: must be an integer"),
        ({"targets": torch.zeros(2, dtype=torch.bool)}, "targets: must be an integer"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, r"targets: shape \(3,\) must equal"),
        ({"targets": torch.tensor([0, 4])}, r"targets: ids must lie in \[0, 4\)"),
        ({"targets": torch.tensor([-1, 0])}, r"targets: ids must lie in \[0, 4\)"),
        ({"temperature": 0.0}, "temperature: must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature: must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature: must be a finite number > 0"),
        ({"temperature": "1"}, "temperature: must be a number"),
        ({"chunk_size": 0}, "chunk_size: must be a positive int"),
        ({"chunk_size": -3}, "chunk_size: must be a positive int"),
        ({"chunk_size": 2.0}, "chunk_size: must be a positive int"),
        ({"logits": torch.tensor([[0.0, float("nan"), 0, 0], [0.0] * 4])}, "logits: must be fin"),
        ({"logits": torch.tensor([[0.0, float("inf"), 0, 0], [0.0] * 4])}, "logits: must be fin"),
    ],
)
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_bad_inputs_raise(kwargs, match, chunk_size):
    args = {"logits": torch.zeros(2, 4), "targets": torch.tensor([1, 3]), "chunk_size": chunk_size}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(args.pop("logits"), args.pop("targets"), **args)


def test_comparison_can_fail():
    # negative control for the helpers: a wrong target or a missing temperature is caught
    logits, targets = make_case(6, (10,), 20)
    lp, _, grad = ours(logits, targets, temperature=0.5)
    assert rel_err(lp, reference(logits, (targets + 1) % 20, 0.5)[0]) > 1e-2
    assert rel_err(grad, reference(logits, targets, 1.0)[2]) > 1e-2


# --- TP = 2 and TP = 4 on gloo processes ----------------------------------------------------------

WORLD = 4
CASES = [  # seed, leading dims, vocab, temperature, chunk sizes, dtype
    (10, (2, 7), 24, 1.0, (None, 1, 5, 64), torch.float32),
    (11, (3, 5), 40, 0.6, (None, 4), torch.float32),
    (12, (9,), 16, 1.7, (None, 2), torch.bfloat16),
]


def _gather_grad(grad: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(grad) for _ in range(size)]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _shard(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    v = full.shape[-1] // size
    return full[..., rank * v : (rank + 1) * v]


def _tp_checks(rank: int, errs: dict) -> None:
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    layouts = {2: (tp2, rank % 2), 4: (dist.group.WORLD, rank)}
    for seed, lead, vocab, tau, chunks, dtype in CASES:
        logits, targets = make_case(seed, lead, vocab, dtype=dtype)
        r_lp, r_h, r_grad = reference(logits, targets, tau)
        for tp, (group, tp_rank) in layouts.items():
            shard = _shard(logits, tp_rank, tp)
            for chunk in chunks:
                lp, h, grad = ours(
                    shard, targets, tp_group=group, temperature=tau, chunk_size=chunk
                )
                full_grad = _gather_grad(grad, group, tp)
                key = f"seed{seed}/tp{tp}/chunk{chunk}"
                errs[f"{key}/logprobs"] = rel_err(lp, r_lp)
                errs[f"{key}/entropy"] = rel_err(h, r_h)
                tol_grad = 1e-2 if dtype == torch.bfloat16 else None  # grad comes back in bf16
                errs[f"{key}/grad" + ("@bf16" if tol_grad else "")] = rel_err(full_grad, r_grad)
                if chunk not in (None, 1) and seed == 10:
                    # negative controls: the shard of the next rank, and no TP reduction at all
                    wrong = _shard(logits, (tp_rank + 1) % tp, tp)
                    w_lp, _, w_grad = ours(wrong, targets, tp_group=group, chunk_size=chunk)
                    errs[f"neg/{key}/wrong_shard"] = max(
                        rel_err(w_lp, r_lp), rel_err(_gather_grad(w_grad, group, tp), r_grad)
                    )
                    # (targets folded into the shard only so that the call is valid)
                    _, n_h, _ = ours(shard, targets % shard.shape[-1], chunk_size=chunk)
                    errs[f"neg/{key}/no_all_reduce"] = rel_err(n_h, r_h)


def _megatron_checks(rank: int, errs: dict) -> None:
    """Same shard convention as megatron-core: -vocab_parallel_cross_entropy == our logprobs."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    try:
        logits, targets = make_case(20, (6, 2), 32)  # megatron's [s, b, V/TP] layout
        shard = _shard(logits, rank, WORLD)
        group = parallel_state.get_tensor_model_parallel_group()
        ours_lp = vocab_parallel_logprobs(shard, targets, tp_group=group, chunk_size=5)
        theirs = -tensor_parallel.vocab_parallel_cross_entropy(shard.clone(), targets)
        errs["megatron/logprobs"] = rel_err(ours_lp, theirs)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    errs: dict[str, float] = {}
    try:
        _tp_checks(rank, errs)
        _megatron_checks(rank, errs)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(errs, f)
        dist.destroy_process_group()


@pytest.mark.distributed
def test_tp2_tp4_on_gloo_match_full_vocab_float64(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    checked = 0
    for rank, errs in enumerate(results):
        assert "megatron/logprobs" in errs, f"rank {rank} did not finish"
        for key, err in errs.items():
            if key.startswith("neg/"):
                assert err > 1e-2, f"rank {rank}: negative control {key} passed ({err:.2e})"
            else:
                tol = 1e-2 if key.endswith("@bf16") else TOL32
                assert err < tol, f"rank {rank}: {key} error {err:.2e} >= {tol}"
            checked += 1
    per_rank = sum(3 * 2 * len(case[4]) for case in CASES) + 2 * 2 * 2 + 1
    assert checked == WORLD * per_rank  # every case (and control) ran on every rank


def test_bench_command_runs_the_vocab_parallel_benchmark(capsys):
    # a tiny size: checks the dispatch and every variant's code path, not the figures
    from megatron_ba.cli import main

    argv = "perf vocab-parallel --tokens 48 --vocab 64 --tp 2 --rounds 1 --chunk-sizes 7"
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    for variant in ("naive", "unchunked", "chunked:7"):
        assert f"\n{variant} " in out
    assert "chunked:7: memory <= 1/8 of naive:" in out
