"""Single-process pieces of the megatron-core integration: scaling table, reducer, batch layout.

    python -m pytest tests/test_megatron_units.py

Runs in this process without torch.distributed; the one check that needs megatron-core's
parallel state (cpu_compat, the model builder's shapes) runs in a subprocess so that the shims
never leak into other tests. The distributed behaviour is in tests/test_layout_matrix.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from megatron_ba.megatron import loss_scale
from megatron_ba.megatron.batching import (
    CPView,
    GRPOBatch,
    causal_mask,
    label_aligned,
    prepare_microbatches,
)
from megatron_ba.megatron.model import ModelSpec, full_parameter_shapes, tiny_qwen2_spec
from megatron_ba.megatron.packing import fixed_count_microbatches
from megatron_ba.parallel.collectives import StatisticsReducer, statistics_payload_bytes
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.parallel.world import free_port

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.mark.parametrize(
    ("version", "per_token", "expected"),
    [
        ((0, 16), False, 3 * 2 * 2),  # schedule 1/M, DDP 1/(DP x CP)
        ((0, 16), True, 3 * 2 * 2),  # finalize_model_grads: 1/(num_tokens over DP x CP)
        ((0, 19), True, 3 * 2 * 2),
        ((0, 13), True, 3 * 2 * 2),
        ((0, 12), False, 3 * 2),  # 0.12's forward_step multiplies the loss by CP
        ((0, 12), True, 3 * 2),  # num_tokens all-reduced over DP without CP before 0.13
        ((0, 10), False, 3 * 2 * 2),
        ((0, 10), True, 3 * 2),
    ],
)
def test_loss_scale_table(version, per_token, expected):
    got = loss_scale.loss_scale(3, 2, 2, per_token_loss=per_token, version=version)
    assert got == expected


def test_loss_scale_installed_version_and_errors():
    pytest.importorskip("megatron.core")
    assert loss_scale.megatron_core_version() >= (0, 10)
    assert loss_scale.loss_scale(1, 1, 1, per_token_loss=False) == 1
    with pytest.raises(ValueError, match="num_microbatches"):
        loss_scale.loss_scale(0, 1, 1, per_token_loss=False, version=(0, 16))
    with pytest.raises(ValueError, match=r"before 0\.10"):
        loss_scale.loss_scale(1, 1, 1, per_token_loss=False, version=(0, 9))


def test_statistics_reducer_counts_calls_and_bytes():
    # Hand-computed payload: [groups, 10] float64 = groups x 80 bytes.
    assert statistics_payload_bytes(128) == 10_240
    assert statistics_payload_bytes(4096) == 327_680
    reducer = StatisticsReducer(group=None)
    table = torch.ones(128, 10, dtype=torch.float64)
    assert reducer(table) is table  # no group: this process holds the whole batch
    reducer(torch.ones(4096, 10, dtype=torch.float64))
    assert reducer.calls == 2
    assert reducer.history == [10_240, 327_680]
    assert reducer.bytes_reduced == 337_920
    with pytest.raises(ValueError, match="float64"):
        reducer(torch.ones(2, 10))


def _batch(n=4, s=8):
    tokens = torch.arange(n * s).view(n, s)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, 3:6] = True
    return GRPOBatch(
        tokens, mask, torch.ones(n), torch.zeros(n, dtype=torch.long), -torch.rand(n, s)
    )


def test_grpo_batch_checks():
    b = _batch()
    assert b.checked().lengths.tolist() == [3, 3, 3, 3]
    bad_mask = b.response_mask.clone()
    bad_mask[0, 0] = True
    with pytest.raises(ValueError, match="response_mask: position 0"):
        replace(b, response_mask=bad_mask).checked()
    with pytest.raises(ValueError, match="lengths: must be the whole-sequence"):
        replace(b, lengths=torch.tensor([3, 3, 2, 3])).checked()  # e.g. a CP shard's lengths
    with pytest.raises(ValueError, match="old_logprobs: must have the shape"):
        replace(b, old_logprobs=torch.zeros(4, 7)).checked()
    with pytest.raises(ValueError, match="advantages: must be"):
        replace(b, advantages=torch.zeros(3)).checked()


def test_label_alignment_and_microbatches():
    x = torch.tensor([[10, 11, 12, 13]])
    assert label_aligned(x, 0).tolist() == [[11, 12, 13, 0]]
    assert fixed_count_microbatches(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert fixed_count_microbatches(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]  # need not divide
    with pytest.raises(ValueError, match="num_microbatches"):
        fixed_count_microbatches(3, 4)
    # CP = 2 on S = 6: padded to 8, rank 1 holds positions 2..5 of the position-aligned arrays.
    b = _batch(n=2, s=6).checked()
    data, seq_len, mbs = prepare_microbatches(b, CPView(cp=2, rank=1, mode="loss"), 2)
    assert (seq_len, mbs, len(data)) == (16, 1, 2)  # loss mode announces S_pad x CP
    assert data[0]["input_ids"].shape == (1, 8)  # whole (padded) sequences into the model
    assert data[0]["targets"].tolist() == [[3, 4, 5, 0]]  # tokens 3..5 then padding
    assert data[0]["mask"].tolist() == [[True, True, True, False]]  # p predicts token p + 1
    model_mode = prepare_microbatches(b, CPView(cp=2, rank=1, mode="model", causal_mask=False), 1)
    assert model_mode[0][0]["input_ids"].tolist() == [[2, 3, 4, 5], [8, 9, 10, 11]]


def test_causal_mask_hand_computed():
    # True = cut: query q sees keys k <= q.
    assert causal_mask(3).tolist() == [[[[False, True, True], [False, False, True], [False] * 3]]]
    # Left padding: the padded key 0 of row 0 is cut for every query; row 1 is plain causal.
    valid = torch.tensor([[False, True, True], [True, True, True]])
    m = causal_mask(3, valid=valid)
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, True, True], [True, False, True], [True, False, False]]
    assert torch.equal(m[1], causal_mask(3)[0])
    with pytest.raises(ValueError, match=r"valid: must be \[B, 3\]"):
        causal_mask(3, valid=torch.ones(2, 4, dtype=torch.bool))
    # The batch's model inputs carry it (whole sequences, local attention).
    b = _batch(n=2, s=6).checked()
    data, _, _ = prepare_microbatches(b, CPView(cp=1, rank=0, mode="loss"), 1)
    assert torch.equal(data[0]["attention_mask"], causal_mask(6))


def test_qwen2_spec_errors_and_shapes():
    with pytest.raises(ValueError, match="num_query_groups"):
        ModelSpec(16, 64, 2, 4, 3, 32)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec(16, 66, 2, 4, 2, 32)
    spec = tiny_qwen2_spec()
    with pytest.raises(ValueError, match="num_layers=4 is not a multiple of pp=3"):
        ParallelLayout(pp=3).check_model(spec)
    shapes = full_parameter_shapes(spec)
    qkv = (4 + 2 * 2) * 16  # 4 query heads and 2 (k, v) pairs of head_dim 16
    assert shapes["decoder.layers.3.self_attention.linear_qkv.weight"] == (qkv, 64)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 96, 64)


def test_megatron_modules_import_lazily_and_shims_are_idempotent(tmp_path):
    """In a fresh process: importing our modules does not import megatron-core; install() twice
    patches once; the CPU seeding replaces a default RNG tracker made before it; the built
    model's parameters are exactly full_parameter_shapes()."""
    pytest.importorskip("megatron.core")
    code = textwrap.dedent(
        """
        import sys, warnings, os
        warnings.filterwarnings("ignore")
        import megatron_ba.megatron.grpo_step, megatron_ba.megatron.model
        import megatron_ba.layout_equivalence.check, megatron_ba.megatron.cpu_optimizer
        assert not any(m.startswith("megatron.core") for m in sys.modules), "eager import"
        import torch
        from megatron_ba.megatron import cpu_compat
        first, second = cpu_compat.install(), cpu_compat.install()
        assert first == [
            "torch.cuda.current_device",
            "pipeline_parallel.schedules.torch",
            "distributed.param_and_grad_buffer.torch",
            "tensor_parallel.random._get/_set_cuda_rng_state",
        ], first
        assert second == [] and cpu_compat.installed() == first
        from megatron_ba.parallel import collectives
        collectives.init_process_group("gloo", rank=0, world_size=1, port=int(sys.argv[1]))
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        # A default tracker made before the seeding (megatron-core's, which reads CUDA RNG
        # states) must be replaced, not kept: its add() fails without CUDA.
        from megatron.core import tensor_parallel
        tensor_parallel.get_cuda_rng_tracker()
        cpu_compat.seed_model_parallel_rng(0)
        from megatron_ba.megatron import model as mm
        from megatron_ba.parallel import full_shape
        spec = mm.tiny_qwen2_spec()
        chunks = mm.build_model_chunks(spec)
        got = {k: tuple(v.shape) for k, v in full_shape.gather_full_state_dict(chunks).items()}
        assert got == mm.full_parameter_shapes(spec), set(got) ^ set(mm.full_parameter_shapes(spec))
        print("OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_sequence_parallel_norm_shim_marks_the_norm_and_changes_nothing_without_sp():
    """cpu_compat shim 6: WrappedTorchNorm under sequence parallelism is the same torch norm,
    its weight marked for finalize_model_grads' TP all-reduce; without SP, megatron-core's own
    path (no mark); installing twice patches once."""
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_ba.megatron import cpu_compat

    fields = dict(
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )
    cpu_compat.install_sequence_parallel()  # a no-op if an earlier test installed it
    assert cpu_compat.install_sequence_parallel() == []
    assert "transformer.torch_norm.WrappedTorchNorm" in cpu_compat.installed()
    sp = WrappedTorchNorm(SimpleNamespace(sequence_parallel=True, **fields), 8, eps=1e-6)
    plain = WrappedTorchNorm(SimpleNamespace(sequence_parallel=False, **fields), 8, eps=1e-6)
    assert type(sp) is type(plain) is torch.nn.RMSNorm and sp.eps == plain.eps == 1e-6
    assert sp.weight.sequence_parallel is True
    assert not hasattr(plain.weight, "sequence_parallel")
