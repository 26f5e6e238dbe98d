"""YaRN RoPE scaling: a Hugging Face Qwen3 with YaRN, converted, gives transformers' logits.

    python -m pytest tests/test_rope_yarn.py      # one spawned process (~25 s on 2 cores)

Two tiny random `Qwen3ForCausalLM` checkpoints saved by transformers with YaRN (factor 4 over
original_max_position_embeddings 128, max_position_embeddings 512, rope_theta 10000: the
correction ramp spans rotary frequencies 0-6 of 16, head_dim 32): "rope_parameters"
(transformers 5's form, as save_pretrained writes it) and "rope_scaling" (the same model with
config.json rewritten in 4.x's form: top-level rope_theta and `rope_scaling`). Each is
converted (megatron_ba.conversion), built in megatron-core (local spec,
`position_embedding_type="yarn"`, float32, CPU) and run on SEQ_LEN tokens, longer than
original_max_position_embeddings so that positions past the original context are scored:

- logits agree with transformers' float32 logits to AGREE32 (max abs difference; measured
  7.2e-7 on both releases; logits ~0.1-1);
- negative controls (on the first form; the second holds the same weights), each seen to
  disagree by more than DISAGREE (measured 0.52 and 0.24): the same weights with the scaling
  dropped (plain RoPE, rope_scaling=None), and YaRN without its attention factor (yarn_mscale 0:
  cos and sin not multiplied by 0.1 ln 4 + 1);
- exported back to Hugging Face, every tensor is bit-identical and config.json is the source's
  (same keys, values and JSON types: `json.dumps(..., sort_keys=True)` equal).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

# found, not imported: the spawned worker imports them (the parent would pay the imports twice)
for _name in ("megatron.core", "transformers"):
    if importlib.util.find_spec(_name.split(".")[0]) is None:
        pytest.skip(f"{_name} is not installed", allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]

AGREE32 = 1e-5
DISAGREE = 1e-3
SEQ_LEN = 300
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
THETA = 10000.0


def build_checkpoints(root):
    """The transformers-5 form as saved, and a copy of it rewritten in the 4.x form."""
    import shutil

    from megatron_ba.testing.tiny_hf import build_tiny_qwen3

    new = build_tiny_qwen3(
        root / "rope_parameters",
        seed=5,
        max_position_embeddings=512,
        rope_parameters={**YARN, "rope_theta": THETA},
    )
    old = root / "rope_scaling"
    shutil.copytree(new, old)
    cfg = json.loads((old / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=THETA, rope_scaling=dict(YARN))
    (old / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"rope_parameters": str(new), "rope_scaling": str(old)}


def _hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        return model(ids).logits


def _megatron_logits(spec, model_dir, ids):
    from megatron_ba.conversion import load_hf_into_chunks
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.batching import causal_mask

    chunks = mm.build_model_chunks(spec, ddp=False)
    load_hf_into_chunks(chunks, model_dir, spec)
    s = ids.shape[1]
    with torch.no_grad():
        return chunks[0](ids, torch.arange(s)[None], causal_mask(s)), chunks


def _check(model_dir, export_dir, controls: bool) -> dict:
    from unittest import mock

    from megatron_ba.conversion import export_chunks_to_hf, spec_from_hf_dir
    from megatron_ba.megatron import rope
    from tests.conversion_agreement import compare_folders

    spec = spec_from_hf_dir(model_dir)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (1, SEQ_LEN), generator=g)
    ref = _hf_logits(model_dir, ids)
    got, chunks = _megatron_logits(spec, model_dir, ids)
    r = {"yarn": float((got - ref).abs().max()), "kind": type(chunks[0].rotary_pos_emb).__name__}
    if controls:  # the same weights in both forms: the controls run on the first
        plain, _ = _megatron_logits(spec.of(spec, rope_scaling=None), model_dir, ids)
        r["plain_rope"] = float((plain - ref).abs().max())
        real = rope.yarn_fields
        with mock.patch.object(rope, "yarn_fields", lambda s: {**real(s), "yarn_mscale": 0.0}):
            flat, _ = _megatron_logits(spec, model_dir, ids)
        r["no_attention_factor"] = float((flat - ref).abs().max())
    export_chunks_to_hf(chunks, spec, export_dir, source_dir=model_dir)
    r["export"] = compare_folders(__import__("pathlib").Path(model_dir), export_dir)
    a, b = (json.loads((d / "config.json").read_text()) for d in (model_dir, export_dir))
    r["config_json_equal"] = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return r


def worker(rank: int, port: int, root: str, out: str) -> None:
    from pathlib import Path

    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    dirs = build_checkpoints(Path(root))
    setup(ParallelLayout(dp=None), seed=0, rank=rank, world_size=1, port=port)
    results = {}
    for name, d in dirs.items():
        export = Path(out).parent / f"export-{name}"
        results[name] = _check(Path(d), export, controls=name == "rope_parameters")
    Path(out).write_text(json.dumps(results))
    teardown()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from megatron_ba.parallel.world import free_port, spawn

    root = tmp_path_factory.mktemp("yarn")
    out = root / "results.json"
    spawn(worker, 1, (free_port(), str(root), str(out)))
    results = json.loads(out.read_text())
    print(json.dumps(results, indent=1), file=sys.stderr)
    return results


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_megatron_yarn_logits_equal_transformers_past_the_original_context(measured, form):
    r = measured[form]
    assert r["kind"] == "YarnRotaryEmbedding"
    assert r["yarn"] < AGREE32, r


def test_negative_controls_disagree(measured):
    r = measured["rope_parameters"]
    assert r["plain_rope"] > DISAGREE, r
    assert r["no_attention_factor"] > DISAGREE, r


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_round_trip_is_bit_exact_config_included(measured, form):
    e = measured[form]["export"]
    assert e["same_keys"] and not e["unequal_tensors"] and not e["config_diff"], e
    assert measured[form]["config_json_equal"]
