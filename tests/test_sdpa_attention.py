"""The SDPA core attention (megatron_ba/megatron/sdpa_attention.py) equals megatron-core's unfused
DotProductAttention: hand-checked cases, refusals, and (one 2-rank gloo spawn, tests/sdpa_worker.py)
float64 forward and backward at TP=2 and TP=1 for MHA and GQA, core and whole model, each with a
control that differs in one property and fails. Run under both environments:

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_sdpa_attention.py  # megatron-core 0.16.1
    PYTHONPATH=$PWD $PY312 -m pytest tests/test_sdpa_attention.py    # a Python 3.12 venv: 0.19.2
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType

from megatron_ba.megatron import mcore_compat
from megatron_ba.megatron import sdpa_attention as sa
from megatron_ba.megatron.batching import causal_mask

sys.path.insert(0, str(Path(__file__).parent))
import sdpa_worker

TP1 = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))  # a process-group collection of TP=1
FLOAT64_TOL = 1e-12  # measured differences are <= 2.1e-15 (relative to each tensor's max)


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _config(heads=1, groups=1, kv=1, **changes):
    return sdpa_worker._config(heads, groups, tp=1, kv_channels=kv, **changes)


def _core(config=None, mask_type=AttnMaskType.causal, **kwargs):
    return sa.SDPAttention(config or _config(), 1, mask_type, "self", pg_collection=TP1, **kwargs)


# --- hand-checked ------------------------------------------------------------------------------


def _two_positions(heads: int):
    """s=2, b=1, d=1: keys 0 and ln 3, values 0 and 1; query h is h + 1 (one shared kv group)."""
    q = torch.tensor([[1.0], [1.0]], dtype=torch.float64)[:, None, None, :].repeat(1, 1, heads, 1)
    q = q * torch.arange(1, heads + 1, dtype=torch.float64)[None, None, :, None]
    k = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64).view(2, 1, 1, 1)
    v = torch.tensor([0.0, 1.0], dtype=torch.float64).view(2, 1, 1, 1)
    return q, k, v


def test_hand_checked_causal_gqa_and_controls():
    # Position 1, query 1: scores (0, ln 3) -> weights (1/4, 3/4) -> 0.75; query 2: scores
    # (0, 2 ln 3) -> (1/10, 9/10) -> 0.9. Position 0 sees key 0 alone -> value 0.
    q, k, v = _two_positions(heads=2)
    core = _core(_config(heads=2, groups=1), softmax_scale=1.0)
    for mask in (causal_mask(2), None):
        out = core(q, k, v, mask)
        assert out.shape == (2, 1, 2)
        torch.testing.assert_close(out[:, 0], torch.tensor([[0.0, 0.0], [0.75, 0.9]]).double())
    # Controls: without the causal mask position 0 sees both keys (0.75, 0.9 again); with
    # scale 2 query 1 at position 1 gets (1/10, 9/10) -> 0.9.
    no_mask = _core(_config(heads=2, groups=1), AttnMaskType.no_mask, softmax_scale=1.0)
    torch.testing.assert_close(no_mask(q, k, v, None)[0, 0], torch.tensor([0.75, 0.9]).double())
    scaled = _core(_config(heads=2, groups=1), softmax_scale=2.0)
    assert scaled(q, k, v, None)[1, 0, 0].item() == pytest.approx(0.9, abs=1e-15)


def test_default_scale_is_one_over_sqrt_head_dim():
    assert _core(_config(kv=16)).softmax_scale == 0.25
    assert _core(_config(kv=16), softmax_scale=0.5).softmax_scale == 0.5


def test_a_query_cut_from_every_key_gets_the_mean_value_and_no_score_gradient():
    q, k, v = _two_positions(heads=1)
    q.requires_grad_(True)
    cut_all = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    cut_all[0, 0, 1, 0] = False  # position 1 sees key 0 only; position 0 sees nothing
    out = _core(softmax_scale=1.0)(q, k, v, cut_all)
    torch.testing.assert_close(out[:, 0, 0], torch.tensor([0.5, 0.0]).double())  # mean, v0
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))  # neither row's scores reach the output


def test_gqa_expanded_in_float64_matches_the_reference():
    assert mcore_compat.sdpa_has_enable_gqa()  # torch >= 2.5 here
    assert not sa.gqa_in_kernel(torch.float64) and not sa.gqa_in_kernel(torch.float32)
    q, k, v, w = sdpa_worker._full_qkv(8, 2, seed=1)
    core = _core(_config(heads=8, groups=2, kv=sdpa_worker.HEAD_DIM))
    mask = causal_mask(sdpa_worker.SEQ)
    got = sdpa_worker._run_core(core, (q, k, v, w), mask)
    scale = 1 / math.sqrt(sdpa_worker.HEAD_DIM)
    ref = sdpa_worker._run_core(
        lambda a, b, c, m: sdpa_worker.reference_attention(a, b, c, mask, scale), (q, k, v, w), None
    )
    assert sdpa_worker._diff(got, ref) <= FLOAT64_TOL
    wrong_groups = sdpa_worker._run_core(  # control: the kv groups swapped
        core, (q, k.flip(2), v.flip(2), w), mask
    )
    assert sdpa_worker._diff(wrong_groups, ref) > 0.1


@pytest.mark.parametrize("in_kernel", [True, False])
def test_gqa_in_bf16_through_enable_gqa_or_expanded(monkeypatch, in_kernel):
    assert sa.gqa_in_kernel(torch.bfloat16)  # half precision: SDPA's enable_gqa
    monkeypatch.setattr(mcore_compat, "sdpa_has_enable_gqa", lambda: in_kernel)
    q, k, v, w = (t.bfloat16() for t in sdpa_worker._full_qkv(8, 2, seed=1))
    core = _core(_config(heads=8, groups=2, kv=sdpa_worker.HEAD_DIM))
    mask = causal_mask(sdpa_worker.SEQ)
    got = sdpa_worker._run_core(core, (q, k, v, w), mask)
    scale = 1 / math.sqrt(sdpa_worker.HEAD_DIM)
    exact = [t.double() for t in (q, k, v, w)]  # the bf16 inputs, computed in float64
    ref = sdpa_worker._run_core(
        lambda a, b, c, m: sdpa_worker.reference_attention(a, b, c, mask, scale), exact, None
    )
    assert sdpa_worker._diff([t.double() for t in got], ref) <= 2e-2  # bf16: 8 mantissa bits
    wrong_groups = sdpa_worker._run_core(core, (q, k.flip(2), v.flip(2), w), mask)
    assert sdpa_worker._diff([t.double() for t in wrong_groups], ref) > 0.1


def test_is_causal_pattern_only_for_the_exact_causal_mask():
    assert sa.is_causal_pattern(causal_mask(5), 5, 5)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, 0] = False
    assert not sa.is_causal_pattern(causal_mask(5, valid=valid), 5, 5)  # padding: [2, 1, 5, 5]
    assert not sa.is_causal_pattern(causal_mask(5).transpose(-1, -2), 5, 5)
    assert not sa.is_causal_pattern(causal_mask(5).float(), 5, 5)
    assert not sa.is_causal_pattern(causal_mask(5), 5, 6)


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(attention_dropout=0.1), r"^attention_dropout: model\.attention sdpa runs without"),
        (dict(softmax_type="off-by-one"), r"^softmax_type: .* got 'off-by-one'"),
        (dict(window_size=(4, 0)), r"^window_size: sliding-window attention"),
        (dict(qk_clip=True), r"^qk_clip: needs the attention logits"),
    ],
)
def test_unsupported_settings_are_refused_by_name(changes, message):
    try:
        config = _config(**changes)
    except (TypeError, AssertionError, ValueError) as e:  # a field this megatron-core lacks
        pytest.skip(f"TransformerConfig does not take {changes}: {e}")
    with pytest.raises(ValueError, match=message):
        _core(config)


def test_context_parallelism_and_dropout_argument_are_refused():
    config = _config()
    config.context_parallel_size = 2
    with pytest.raises(ValueError, match=r"^context_parallel_size: model\.attention sdpa does not"):
        _core(config)
    with pytest.raises(ValueError, match=r"^attention_dropout: "):
        _core(attention_dropout=0.2)


def test_bad_forward_inputs_are_refused_by_name():
    q, k, v = _two_positions(heads=1)
    core = _core()
    with pytest.raises(ValueError, match=r"^packed_seq_params: packed \(THD\) sequences need"):
        core(q, k, v, None, packed_seq_params=object())
    with pytest.raises(ValueError, match=r"^attention_bias: not supported"):
        core(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match=r"^attention_mask: must be a bool tensor"):
        core(q, k, v, torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match=r"^attention_mask: last two dims must be"):
        core(q, k, v, torch.zeros(1, 1, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^attention_mask: causal attention without a mask"):
        core(q[:1], k, v, None)
    with pytest.raises(ValueError, match=r"^attn_mask_type: .* differs from"):
        core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match=r"^query/key: 2 heads and 1 groups on this rank"):
        core(q.repeat(1, 1, 2, 1), k, v, None)


def test_sdpa_layer_spec_swaps_the_core_only():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_ba.megatron.model import local_layer_spec

    local = local_layer_spec()
    swapped = sa.sdpa_layer_spec(local)
    assert swapped.submodules.self_attention.submodules.core_attention is sa.SDPAttention
    assert local.submodules.self_attention.submodules.core_attention is DotProductAttention
    for name in ("linear_qkv", "linear_proj"):
        assert getattr(swapped.submodules.self_attention.submodules, name) is getattr(
            local.submodules.self_attention.submodules, name
        )
    assert swapped.submodules.mlp == local.submodules.mlp


# --- float64, TP=2 and TP=1, core and whole model (one spawn) ---------------------------------


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path_factory.mktemp("sdpa")
    spawn(sdpa_worker.worker, 2, (2, free_port(), str(out)))
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("tp", [2, 1])
@pytest.mark.parametrize("shape", sorted(sdpa_worker.SHAPES))
def test_core_equals_unfused_in_float64(found, tp, shape):
    heads, _ = sdpa_worker.SHAPES[shape]
    for rank in (0, 1):
        f = found[rank][tp]["core"][shape]
        assert f["heads_on_rank"] == heads // tp
        for key in (
            "unfused_vs_reference",
            "sdpa_vs_reference",
            "sdpa_vs_unfused",
            "sdpa_no_mask_vs_unfused",
            "padded_unfused_vs_reference",
            "padded_sdpa_vs_unfused",
            "layer_scaled_unfused_vs_unfused",
            "layer_scaled_sdpa_vs_unfused",
        ):
            assert f[key] <= FLOAT64_TOL, (rank, key, f[key])
        # Controls, one property each: no causal mask; a softmax scale 1.25 times the right one.
        assert f["control_non_causal_vs_unfused"] > 0.1, f
        assert f["control_scale_vs_unfused"] > 0.1, f


@pytest.mark.parametrize("tp", [2, 1])
def test_whole_model_equals_unfused(found, tp):
    for rank in (0, 1):
        m = found[rank][tp]["model"]
        assert m["cores"] == ("DotProductAttention", "SDPAttention")
        assert m["logits_dtype"] == "torch.float64" and m["same_keys"] and m["num_grads"] == 31
        s, c = m["sdpa"], m["control"]
        # Direct float64 forward/backward of a fixed linear function of the (vocab-shard) logits.
        assert s["logits"] <= FLOAT64_TOL and s["grads"] <= FLOAT64_TOL, s
        # The GRPO step (fp32 log-probs, fp32 DDP gradient buffers): loss and full gradients.
        assert s["loss"] <= 1e-9 and s["step_grads"] <= 1e-6, s
        # Control: the SDPA model with softmax_scale 1.25 / sqrt(d).
        assert c["logits"] > 1e-4 and c["grads"] > 1e-4, c
        assert c["loss"] > 1e-7 and c["step_grads"] > 1e-4, c


# --- `megatron-ba perf attention` (the GPU check's accuracy criterion), on the CPU ---------------

BENCH_CONTROL = """
import json, sys
from types import SimpleNamespace
import torch
from megatron_ba.perf import attention_perf as ba
from megatron_ba.megatron.batching import causal_mask
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.parallel_layout import ParallelLayout

args = ba.build_parser().parse_args("--device cpu --seq-len 48 --batch 2".split())
cpu, mask = torch.device("cpu"), causal_mask(48)
setup(ParallelLayout(dp=None), seed=0)
right = ba.accuracy(args, "fp32", cpu, mask)
cores = ba._cores
def wrong_scale(a, dtype):  # control: the SDPA core with 1.1 times the softmax scale
    out = cores(a, dtype)
    out["sdpa"].softmax_scale *= 1.1
    return out
ba._cores = wrong_scale
wrong = ba.accuracy(args, "fp32", cpu, mask)
teardown()
print(json.dumps({"right": right, "wrong": wrong}))
"""


def test_bench_attention_criterion_and_its_control():
    p = subprocess.run(
        [sys.executable, "-c", BENCH_CONTROL],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    right, wrong = found["right"], found["wrong"]
    assert right["ok"] and right["sdpa_rel_err"] <= 1e-5 and right["unfused_rel_err"] <= 1e-5
    assert not wrong["ok"] and wrong["sdpa_rel_err"] > 1e-2, wrong
