"""megatron_ba/planning/flops.py: model FLOPs and MFU by hand-computed cases, and N against the
model builder's own parameter table."""

from __future__ import annotations

import math

import pytest

from megatron_ba.model_shape import ModelShape
from megatron_ba.planning import flops

# h 4, 2 query heads and 1 kv head of d 2, ffn 6, vocab 10, 3 layers (untied, Qwen2 biases).
TINY = ModelShape(10, 4, 3, 2, 1, 6, kv_channels=2, name="tiny")


def test_matmul_parameters_by_hand():
    # per layer: qkv 4 x (4 + 2 x 2) = 32, out 4 x 4 = 16, MLP 3 x 4 x 6 = 72 -> 120;
    # 3 layers 360, output layer 10 x 4 = 40 -> 400 (biases, norms, the embedding lookup: 0)
    assert flops.matmul_parameters(TINY) == 400


def test_training_flops_by_hand():
    # S = 3: 6 N S = 6 x 400 x 3 = 7200; causal pairs 3 x 4 / 2 = 6, per pair 12 L H d =
    # 12 x 3 x 2 x 2 = 144 -> 864; total 8064. Full attention: 9 pairs -> 1296; 8496.
    assert flops.training_flops(TINY, [3]) == 8064
    assert flops.training_flops(TINY, [3], attention="full") == 8496
    # S = 1: 2400 + 144 x 1; two sequences add up.
    assert flops.training_flops(TINY, [3, 1]) == 8064 + 2544
    # Control: 6 N S alone (no attention term) is not the figure.
    assert flops.training_flops(TINY, [3]) != 6 * 400 * 3


def test_mfu_and_peak_by_hand():
    assert flops.peak_tflops("NVIDIA H200") == 989.0
    assert flops.peak_tflops("NVIDIA A10") is None
    assert flops.mfu(989e12, 1.0, 989.0) == pytest.approx(1.0)
    assert flops.mfu(2 * 989e12 * 0.4, 2.0, 989.0) == pytest.approx(0.4)
    with pytest.raises(ValueError, match=r"^seconds and peak: must be > 0"):
        flops.mfu(1.0, 0.0, 989.0)
    with pytest.raises(ValueError, match=r"^attention: must be one of"):
        flops.training_flops(TINY, [3], attention="sparse")
    with pytest.raises(ValueError, match=r"^seq_len: must be an integer >= 1"):
        flops.attention_pairs(0)


def test_qwen25_half_b_figures():
    # Qwen2.5-0.5B (tied): per layer 896 x 1152 + 896 x 896 + 3 x 896 x 4864 = 14,909,440;
    # 24 layers + the output layer 151,936 x 896 (the embedding, used once as a matmul).
    shape = ModelShape(151936, 896, 24, 14, 2, 4864, tie_word_embeddings=True, name="q")
    assert flops.matmul_parameters(shape) == 24 * 14_909_440 + 151_936 * 896 == 493_961_216
    # one 4,096-token sequence: 6 N S + 12 x 24 x 14 x 64 x 4096 x 4097 / 2
    want = 6 * 493_961_216 * 4096 + 12 * 24 * 14 * 64 * (4096 * 4097 // 2)
    assert flops.training_flops(shape, [4096]) == want
    assert math.isclose(want, 1.4305e13, rel_tol=1e-4)


def test_matmul_parameters_match_the_builders_table():
    """N = every parameter of the built model but the embedding lookup, norms and biases."""
    from megatron_ba.megatron.model import full_parameter_shapes, tiny_qwen2_spec

    for tie in (False, True):
        spec = tiny_qwen2_spec(tie_word_embeddings=tie)
        table = full_parameter_shapes(spec)
        n = sum(
            math.prod(s)
            for name, s in table.items()
            if name.endswith("weight")
            and "norm" not in name
            and name != "embedding.word_embeddings.weight"
        )
        if tie:  # the tied output layer is the embedding matrix
            n += math.prod(table["embedding.word_embeddings.weight"])
        assert flops.matmul_parameters(spec) == n


def test_models_it_does_not_count_are_refused():
    from megatron_ba.model_shape import PRESETS

    with pytest.raises(ValueError, match="not a mixture of experts"):
        flops.training_flops(PRESETS["tiny-moe"], [3])
    with pytest.raises(ValueError, match="not Gated DeltaNet layers"):
        flops.matmul_parameters(PRESETS["tiny-qwen3.5"])
