"""A Hugging Face Qwen3.5 (dense and MoE) converted to a megatron-core GPTModel gives transformers'
logits.

    python -m pytest tests/test_qwen3_5_model.py      # one spawned process (~1 min on 2 cores)

Two tiny random checkpoints saved by transformers, `Qwen3_5ForCausalLM` ("tiny-qwen3.5": three
Gated DeltaNet layers, then one full-attention layer with its output gate; a quarter of each head
rotated) and `Qwen3_5MoeForCausalLM` ("tiny-qwen3.5-moe": the same layers, every MLP 8 routed
experts and a gated shared expert). Each is read by the project's conversion into megatron-core
(the hybrid spec of megatron_ba/megatron/hybrid.py: megatron-core's GatedDeltaNet through its
torch path, its attention with `attention_output_gate`) and run on the same 24 tokens as
transformers, in float64 and float32:

- logits agree to AGREE64 / AGREE32 (measured 2026-12-07 on megatron-core 0.16.1 and transformers
  5.19: dense 1.1e-7 / 3.6e-7, MoE 1.1e-7 / 3.0e-7, logits ~0.1-1). Not ~1e-16 in float64:
  transformers' gated delta rule (`torch_chunk_gated_delta_rule`) and megatron-core's keep their
  decay cumsums and the rotary frequencies in float32, and the MoE router's softmax runs in
  float32 on both sides;
- float32 negative controls, each a different model in one property, seen to disagree by more
  than DISAGREE (measured >= 0.22): the attention's output gate removed (megatron-core's
  `_apply_output_gate` made the identity), RoPE over every channel instead of the first quarter
  (rotary_percent 1.0), and the layer order swapped (the full-attention layer first, the same
  weights moved with it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.one_process import measure_in_one_process

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]

AGREE64 = 2e-6
AGREE32 = 1e-5
DISAGREE = 1e-3
VARIANTS = ("dense", "moe")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def build_variant(root, name: str):
    from megatron_ba.testing.tiny_hf import build_tiny_qwen3_5, build_tiny_qwen3_5_moe

    build = build_tiny_qwen3_5_moe if name == "moe" else build_tiny_qwen3_5
    return build(root / name, seed=5)


def hf_logits(model_dir, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    # "eager": the per-expert loop (the default grouped_mm takes no float64)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(ids).logits


def _max_abs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _order_swapped(spec, model_dir):
    """The control's spec and per-tensor read: the last layer (full attention) first, layers
    0..L-2 (Gated DeltaNet) after it, each with its own weights."""
    from megatron_ba.conversion import family_table, table_for
    from megatron_ba.conversion.hf_folder import HFCheckpoint

    pattern = spec.linear_attention_pattern
    last = len(pattern) - 1
    swapped = dataclasses.replace(spec, linear_attention_pattern=(pattern[last], *pattern[:last]))
    table, ckpt = table_for(spec), HFCheckpoint(model_dir)

    def read(name: str) -> torch.Tensor:
        prefix = "decoder.layers."
        if name.startswith(prefix):
            index, rest = name[len(prefix) :].split(".", 1)
            source = last if int(index) == 0 else int(index) - 1
            name = f"{prefix}{source}.{rest}"
        return family_table.megatron_tensor(table, spec, name, ckpt.get)

    return swapped, read


def _check_dtype(model_dir, dtype, ids) -> dict:
    from megatron.core.transformer.attention import Attention

    from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.batching import causal_mask
    from megatron_ba.parallel import full_shape

    ref = hf_logits(model_dir, ids, dtype)
    spec = spec_from_hf_dir(model_dir, params_dtype=dtype)
    s = ids.shape[1]

    def run(spec, read=None) -> torch.Tensor:
        config = mm.transformer_config(spec, perform_initialization=False)
        chunks = mm.build_model_chunks(spec, ddp=False, config=config)
        if read is None:
            load_hf_into_chunks(chunks, model_dir, spec)
        else:
            full_shape.load_full_tensors(chunks, read)
        with torch.no_grad():
            return chunks[0](ids, torch.arange(s)[None], causal_mask(s))

    got = run(spec)
    result = {"vs_hf": _max_abs(got, ref)}
    if dtype == torch.float64:
        return result
    gate = Attention._apply_output_gate
    Attention._apply_output_gate = lambda self, x, g: x
    try:
        result["gate_removed_vs_hf"] = _max_abs(run(spec), ref)
    finally:
        Attention._apply_output_gate = gate
    full_rotary = dataclasses.replace(spec, rotary_percent=1.0)
    result["full_rotary_vs_hf"] = _max_abs(run(full_rotary), ref)
    result["order_swapped_vs_hf"] = _max_abs(run(*_order_swapped(spec, model_dir)), ref)
    return result


def compute(dirs: dict) -> dict:
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(7))
    return {
        f"{v}-{d}": _check_dtype(path, dtype, ids)
        for v, path in dirs.items()
        for d, dtype in DTYPES.items()
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    dirs = {v: str(build_variant(root, v)) for v in VARIANTS}
    return measure_in_one_process(compute, dirs, out=root / "result.json")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_megatron_logits_equal_transformers(measured, variant, dtype):
    r = measured[f"{variant}-{dtype}"]
    assert r["vs_hf"] < (AGREE64 if dtype == "float64" else AGREE32), r


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("control", ["gate_removed", "full_rotary", "order_swapped"])
def test_a_different_model_disagrees(measured, variant, control):
    r = measured[f"{variant}-float32"]
    assert r[f"{control}_vs_hf"] > DISAGREE, r
