"""Hugging Face Qwen3-MoE <-> megatron-core conversion: names, fused layouts, configs, commands.

    python -m pytest tests/test_moe_conversion.py

Checkpoints are tiny random `Qwen3MoeForCausalLM`s saved by transformers
(tests/test_moe_model.build_variant: "renorm", every layer sparse; "plain", layer 1 dense).

- HF -> full-shape megatron state dict -> HF is bit-identical (every tensor and dtype), and the
  megatron names and shapes are exactly the model builder's (full_parameter_shapes);
- negative control: the same round trip with experts 0 and 1 of one layer exchanged on the
  megatron side fails the check on exactly those six tensors (run: it fails as it should);
- config.json: spec -> config reproduces the source with it as base, and from scratch is read
  back by transformers to the same spec; unsupported settings are refused by field name;
- at TP=2 (two spawned gloo processes; experts TP-sharded like the dense MLP) the loaded model's
  log-probs equal transformers' (float32, measured 5.4e-7 < 1e-5) and its export is
  bit-identical to the source;
- at EP=2 (two spawned gloo processes, TP=1, 4 experts each) each rank's logits equal
  transformers' (< 1e-5) and the export, which gathers the experts over the EP group under
  global numbers, is bit-identical;
- `megatron-ba convert` HF -> distributed checkpoint -> HF (subprocesses) is bit-identical,
  config.json and tokenizer included; `megatron-ba tiny-model --family qwen3_moe` writes a
  checkpoint of the "tiny-moe" preset's shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ba.conversion import (
    HFCheckpoint,
    hf_config_from_spec,
    hf_named_tensors,
    megatron_state_dict_from_hf,
    spec_from_hf_config,
    spec_from_hf_dir,
)
from megatron_ba.megatron.model import full_parameter_shapes
from megatron_ba.model_shape import PRESETS
from tests.test_moe_model import VARIANTS, build_variant

ROOT = Path(__file__).resolve().parents[1]


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-hf")
    return {v: build_variant(root, v) for v in VARIANTS}


def round_trip_mismatches(src: Path, full: dict[str, torch.Tensor], spec) -> list[str]:
    """HF names whose tensor (values or dtype) differs after megatron -> HF, or is missing."""
    ckpt = HFCheckpoint(src)
    back = dict(hf_named_tensors(full, spec))
    bad = sorted(set(back) ^ set(ckpt.keys()))
    for k in ckpt.keys():
        a = ckpt.get(k)
        if k in back and not (back[k].dtype == a.dtype and torch.equal(back[k], a)):
            bad.append(k)
    return bad


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_megatron_hf_is_bit_identical(ckpts, variant):
    spec = spec_from_hf_dir(ckpts[variant])
    full = megatron_state_dict_from_hf(ckpts[variant], spec)
    assert {k: tuple(v.shape) for k, v in full.items()} == full_parameter_shapes(spec)
    assert round_trip_mismatches(ckpts[variant], full, spec) == []
    router = full["decoder.layers.0.mlp.router.weight"]
    assert torch.equal(router, HFCheckpoint(ckpts[variant]).get("model.layers.0.mlp.gate.weight"))


def test_swapped_experts_fail_the_round_trip(ckpts):
    """Negative control (run, and it fails the check as it must): experts 0 and 1 of layer 0
    exchanged in the megatron state dict come back under each other's HF names."""
    spec = spec_from_hf_dir(ckpts["renorm"])
    full = megatron_state_dict_from_hf(ckpts["renorm"], spec)
    p = "decoder.layers.0.mlp.experts.local_experts."
    for rest in ("linear_fc1.weight", "linear_fc2.weight"):
        full[f"{p}0.{rest}"], full[f"{p}1.{rest}"] = full[f"{p}1.{rest}"], full[f"{p}0.{rest}"]
    names = [
        f"model.layers.0.mlp.experts.{e}.{w}_proj.weight"
        for e in (0, 1)
        for w in ("down", "gate", "up")
    ]
    assert round_trip_mismatches(ckpts["renorm"], full, spec) == sorted(names)


def test_spec_fields_from_config(ckpts):
    renorm, plain = spec_from_hf_dir(ckpts["renorm"]), spec_from_hf_dir(ckpts["plain"])
    assert (renorm.family, renorm.num_experts, renorm.moe_router_topk) == ("qwen3_moe", 8, 2)
    assert renorm.moe_norm_topk_prob and renorm.moe_layer_pattern is None
    assert not plain.moe_norm_topk_prob and plain.moe_layer_pattern == (1, 0)
    assert [plain.is_moe_layer(i) for i in range(2)] == [True, False]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in full_parameter_shapes(plain)
    # transformers 5 writes the expert count as num_local_experts
    assert HFCheckpoint(ckpts["renorm"]).config()["num_local_experts"] == 8
    # the spec a distributed checkpoint stores (JSON: the pattern comes back as a list)
    from megatron_ba.conversion.dist_checkpoint import spec_from_json, spec_to_json

    stored = json.loads(json.dumps(spec_to_json(plain)))
    assert spec_from_json(stored) == plain and spec_from_json(stored).moe_layer_pattern == (1, 0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_from_spec_reproduces_the_source(ckpts, variant, tmp_path):
    from transformers import AutoConfig

    src = HFCheckpoint(ckpts[variant]).config()
    spec = spec_from_hf_config(src)
    assert hf_config_from_spec(spec, base=src) == src
    fresh = hf_config_from_spec(spec)
    (tmp_path / "config.json").write_text(json.dumps(fresh))
    assert spec_from_hf_config(AutoConfig.from_pretrained(tmp_path).to_dict()) == spec


@pytest.mark.parametrize(
    "change, match",
    [
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"mlp_only_layers": [0, 1]}, "mlp_only_layers"),
        ({"num_experts_per_tok": 9}, "moe_router_topk"),
        ({"num_local_experts": None}, "num_experts"),
        ({"num_experts": 4}, "disagree"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_unsupported_settings_are_refused_by_name(ckpts, change, match):
    cfg = HFCheckpoint(ckpts["renorm"]).config() | change
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(cfg)


def tp2_worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    """Load at TP=2, log-probs of a fixed sequence, export (rank 0 writes)."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from tests.conversion_agreement import fixed_sequence

    setup(ParallelLayout(tp=2, dp=None), seed=0, rank=rank, world_size=2, port=port)
    spec = spec_from_hf_dir(hf_dir)
    chunks = mm.build_model_chunks(spec, ddp=False)
    load_hf_into_chunks(chunks, hf_dir, spec)
    # eval: megatron-core refuses MoE with TP > 1 and no sequence parallelism in training mode
    chunks[0].eval()
    lp, _ = compute_logprobs(chunks, torch.tensor([fixed_sequence(spec.vocab_size)]))
    export_chunks_to_hf(chunks, spec, Path(out) / "export", source_dir=hf_dir)
    if rank == 0:
        torch.save(lp[0, 1:], Path(out) / "logprobs.pt")
    teardown()


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_load_matches_transformers_and_exports_bit_identically(ckpts, tmp_path):
    from megatron_ba.parallel.world import free_port, spawn
    from tests.conversion_agreement import compare_folders, fixed_sequence, hf_logprobs

    src = ckpts["plain"]  # a dense layer and a sparse one
    spawn(tp2_worker, 2, (free_port(), str(src), str(tmp_path)))
    ref = hf_logprobs(src, fixed_sequence(spec_from_hf_dir(src).vocab_size))
    lp = torch.load(tmp_path / "logprobs.pt")
    assert float((lp.double() - ref).abs().max()) < 1e-5
    same = compare_folders(src, tmp_path / "export")
    assert same["same_keys"] and same["unequal_tensors"] == [] and same["config_diff"] == []


def ep2_worker(rank: int, port: int, hf_dir: str, out: str) -> None:
    """Load at EP=2 (TP=1; 4 experts per rank), logits of a fixed sequence, export."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks
    from megatron_ba.megatron import cpu_compat
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from tests.conversion_agreement import fixed_sequence
    from tests.test_moe_model import megatron_logits

    setup(ParallelLayout(dp=None), seed=0, rank=rank, world_size=2, port=port)
    # startup.setup has no EP: the same world again with the experts split over both ranks
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    cpu_compat.seed_model_parallel_rng(0)
    spec = spec_from_hf_dir(hf_dir)
    chunks = mm.build_model_chunks(spec, ddp=False)
    load_hf_into_chunks(chunks, hf_dir, spec)
    logits = megatron_logits(chunks, torch.tensor([fixed_sequence(spec.vocab_size)]))
    export_chunks_to_hf(chunks, spec, Path(out) / "export", source_dir=hf_dir)
    torch.save(logits, Path(out) / f"logits-{rank}.pt")
    teardown()


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_load_matches_transformers_and_exports_bit_identically(ckpts, tmp_path):
    """Expert parallelism 2: each rank loads its own half of the experts (global numbers
    e = rank * 4 + j) and the export gathers them back. Control (run by editing
    experts.global_name to keep the local number): the export's gather then finds expert 0 on
    both ranks and the test fails ("held by two stages")."""
    from megatron_ba.parallel.world import free_port, spawn
    from tests.conversion_agreement import compare_folders, fixed_sequence
    from tests.test_moe_model import hf_logits

    src = ckpts["plain"]
    spawn(ep2_worker, 2, (free_port(), str(src), str(tmp_path)))
    ids = torch.tensor([fixed_sequence(spec_from_hf_dir(src).vocab_size)])
    ref = hf_logits(src, ids, torch.float32)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"logits-{rank}.pt")
        assert float((got.double() - ref.double()).abs().max()) < 1e-5, rank
    same = compare_folders(src, tmp_path / "export")
    assert same["same_keys"] and same["unequal_tensors"] == [] and same["config_diff"] == []


def _cli(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_convert_command_round_trip_is_bit_identical(tmp_path):
    from megatron_ba.commands import tiny_model
    from tests.conversion_agreement import compare_folders

    hf = tmp_path / "tiny-moe"
    tiny_model.run(argparse.Namespace(out=hf, family="qwen3_moe", seed=1))
    spec = spec_from_hf_dir(hf)
    shape = PRESETS["tiny-moe"]
    assert (spec.num_experts, spec.moe_router_topk, spec.head_dim) == (8, 2, 32)
    assert spec.moe_ffn_hidden_size == shape.moe_ffn_hidden_size
    ckpt, back = tmp_path / "dist", tmp_path / "back"
    _cli("convert", str(hf), str(ckpt))
    _cli("convert", str(ckpt), str(back), "--to", "hf")
    same = compare_folders(hf, back)
    # per layer 8 attention and norm tensors, the router, 3 per expert; embedding, final norm
    assert same["same_keys"] and same["num_tensors"] == 2 * (8 + 1 + 3 * 8) + 2
    assert same["unequal_tensors"] == [] and same["config_diff"] == []
    assert same["side_files_equal"]


def test_a_dense_layer_spec_is_refused_for_a_moe_spec():
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ba.megatron.model import _check_moe_layer_spec

    with pytest.raises(ValueError, match="layer_spec: a dense layer spec"):
        _check_moe_layer_spec(get_gpt_layer_local_spec(qk_layernorm=True))
    _check_moe_layer_spec(get_gpt_layer_local_spec(num_experts=8, qk_layernorm=True))  # accepted


def test_grouped_gemm_expert_names_fold_onto_sequential_ones(ckpts):
    """Transformer Engine's grouped-GEMM experts (GPUs) name expert e's weights `weight{e}`."""
    from megatron_ba.conversion import family_table, table_for

    table = table_for(spec_from_hf_dir(ckpts["renorm"]))
    assert table.hf_names_of("decoder.layers.1.mlp.experts.linear_fc1.weight3") == [
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    ]
    assert family_table.canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight12") == (
        "decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight"
    )


def test_parameter_counts_agree(ckpts):
    """ModelShape's count (the planner's) equals the builder's shapes, dense layers included."""
    from megatron_ba.megatron.model import ModelSpec

    for spec in (ModelSpec.of(PRESETS["tiny-moe"]), spec_from_hf_dir(ckpts["plain"])):
        assert spec.total_params() == spec.num_parameters()
    ckpt = HFCheckpoint(ckpts["plain"])
    assert spec.num_parameters() == sum(ckpt.get(k).numel() for k in ckpt.keys())
