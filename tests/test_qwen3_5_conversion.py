"""Hugging Face Qwen3.5 (dense and MoE) <-> megatron-core conversion, both checkpoint layouts.

    python -m pytest -q tests/test_qwen3_5_conversion.py

Checkpoints are the tiny "tiny-qwen3.5" / "tiny-qwen3.5-moe" models of
megatron_ba.testing.tiny_hf, saved by transformers, every tensor then redrawn at random (so that
no two tensors share a value: transformers starts the zero-centred norms at 0 and dt_bias at 1):
the text layout (Qwen3_5ForCausalLM), and the published ConditionalGeneration layout with a
vision tower and an MTP head (dense: tied, as the small releases; MoE: experts fused, as
Qwen3.5-35B-A3B ships them).

- HF -> full-shape megatron state dict -> HF is bit for bit (same names, every tensor equal, same
  dtype, config.json equal), the vision / MTP tensors carried from the source; the megatron
  names and shapes are the model builder's (full_parameter_shapes);
- the same through a distributed checkpoint's hf/ folder (what `convert --to hf` reads), for a
  bfloat16 checkpoint that keeps A_log and the DeltaNet norm in float32 as the published ones do;
- without a source the export is the text layout, which transformers loads; a published
  config.json is written back unchanged (a field the spec changes: only that field);
- fused expert tensors read per expert (a state dict as a folder) and are fused back;
- the gated QKV and DeltaNet in_proj layouts against hand constructions on labelled rows (with
  controls: a wrong q / gate interleave and swapped b / a are seen), the gated QKV also against
  transformers' own attention forward;
- refusals: megatron MTP / vision parameters, an unknown layer type and other unsupported config
  fields, a stray language-model tensor;
- `megatron-ba tiny-model --family qwen3_5` writes a folder transformers loads, of the preset's
  shape.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from megatron_ba.conversion import (
    HFCheckpoint,
    family_table,
    hf_config_from_spec,
    hf_experts,
    hf_named_tensors,
    megatron_state_dict_from_hf,
    spec_from_hf_config,
    spec_from_hf_dir,
    table_for,
    write_hf_folder,
)
from megatron_ba.conversion import dist_checkpoint as dc
from megatron_ba.megatron.model import full_parameter_shapes
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.testing.tiny_hf import build_tiny_qwen3_5, build_tiny_qwen3_5_moe

pytestmark = pytest.mark.stack

VARIANTS = {
    "dense": (build_tiny_qwen3_5, {}),
    "dense-conditional-mtp-tied": (
        build_tiny_qwen3_5,
        dict(conditional=True, mtp=True, tie_word_embeddings=True),
    ),
    "moe": (build_tiny_qwen3_5_moe, {}),
    "moe-conditional-mtp-fused": (
        build_tiny_qwen3_5_moe,
        dict(conditional=True, mtp=True, fused_experts=True),
    ),
}


def _redraw(model_dir: Path, seed: int) -> None:
    """Every tensor of the folder redrawn at random (its name, shape and dtype kept)."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for k, v in tensors.items():
        tensors[k] = torch.randn(v.shape, generator=g).to(v.dtype)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5-hf")
    out = {}
    for i, (name, (build, options)) in enumerate(VARIANTS.items()):
        out[name] = build(root / name, seed=i, **options)
        _redraw(out[name], seed=100 + i)
    return out


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _assert_same_folder(src: Path, out: Path) -> None:
    a, b = HFCheckpoint(src), HFCheckpoint(out)
    assert sorted(a.stored_keys()) == sorted(b.stored_keys())
    for k in a.stored_keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert _config(src) == _config(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_is_bit_for_bit(ckpts, variant, tmp_path):
    d = ckpts[variant]
    spec = spec_from_hf_dir(d)
    full = megatron_state_dict_from_hf(d, spec)
    shapes = full_parameter_shapes(spec)
    assert list(full) == table_for(spec).megatron_names(spec)
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(s) for k, s in shapes.items()}
    stored = HFCheckpoint(d).stored_keys()
    carried = [k for k in stored if k.startswith(("model.visual.", "mtp."))]
    assert bool(carried) == ("conditional" in variant)
    assert any(k.endswith("experts.gate_up_proj") for k in stored) == ("fused" in variant)
    out = write_hf_folder(
        tmp_path / "out", hf_named_tensors(full, spec, _config(d)), spec, source_dir=d
    )
    _assert_same_folder(d, out)


def test_megatron_names_and_layouts(ckpts):
    """The full-shape tensors are the HF ones where the tables say so (spot checks by name)."""
    d = ckpts["moe-conditional-mtp-fused"]
    spec, ckpt = spec_from_hf_dir(d), HFCheckpoint(d)
    full = megatron_state_dict_from_hf(d, spec)
    lm = "model.language_model.layers"
    h, d = spec.hidden_size, spec.head_dim
    kd = spec.linear_num_key_heads * spec.linear_key_head_dim
    vd, nv = spec.linear_num_value_heads * spec.linear_value_head_dim, spec.linear_num_value_heads
    in_proj = full["decoder.layers.0.self_attention.in_proj.weight"]
    assert in_proj.shape == (2 * kd + 2 * vd + 2 * nv, h)
    assert torch.equal(in_proj[-nv:], ckpt.get(f"{lm}.0.linear_attn.in_proj_a.weight"))
    assert (spec.num_attention_heads, spec.num_query_groups) == (4, 2)
    qkv = full["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert qkv.shape == (2 * (2 * 2 + 2) * d, h)  # 2 groups of [2 q, 2 gate, k, v] heads
    gate_1 = ckpt.get(f"{lm}.3.self_attn.q_proj.weight")[3 * d : 4 * d]  # head 1's gate
    assert torch.equal(qkv[3 * d : 4 * d], gate_1)  # group 0: q0, q1, gate0, gate1, ...
    fused = ckpt.get(f"{lm}.2.mlp.experts.gate_up_proj")
    assert torch.equal(
        full["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"], fused[5]
    )
    gate = full["decoder.layers.1.mlp.shared_experts.gate_weight"]
    assert torch.equal(gate, ckpt.get(f"{lm}.1.mlp.shared_expert_gate.weight"))
    assert gate.shape == (1, h)


def test_a_fused_state_dict_reads_as_the_folder(ckpts):
    d = ckpts["moe-conditional-mtp-fused"]
    spec = spec_from_hf_dir(d)
    tensors = load_file(str(d / "model.safetensors"))
    from_dict = megatron_state_dict_from_hf(tensors, spec, hf_config=_config(d))
    from_folder = megatron_state_dict_from_hf(d, spec)
    assert from_dict.keys() == from_folder.keys()
    assert all(torch.equal(from_dict[k], from_folder[k]) for k in from_dict)


def _published_dtypes(src: Path, dst: Path) -> Path:
    """A bfloat16 copy of `src` that keeps linear_attn.A_log and linear_attn.norm.weight in
    float32, as the published Qwen3.5 checkpoints do."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for k, v in tensors.items():
        keep = k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))
        tensors[k] = v if keep else v.to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(dst)
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_distributed_checkpoint_meta_carries_what_the_export_needs(ckpts, tmp_path):
    src = _published_dtypes(ckpts["moe-conditional-mtp-fused"], tmp_path / "bf16")
    spec = spec_from_hf_dir(src)
    assert spec.params_dtype == torch.bfloat16
    meta = tmp_path / "ckpt"
    meta.mkdir()
    dc.write_model_meta(meta, spec, source_dir=src)
    kept = HFCheckpoint(meta / dc.HF_META).stored_keys()
    assert kept and all(k.startswith(("model.visual.", "mtp.")) for k in kept)
    layout = json.loads((meta / dc.HF_META / "source_layout.json").read_text())
    assert set(layout["dtypes"].values()) == {"F32"} and len(layout["fused_experts"]) == 2 * 4
    full = megatron_state_dict_from_hf(src, spec)
    cfg = _config(src)
    out = write_hf_folder(
        tmp_path / "out", hf_named_tensors(full, spec, cfg), spec, source_dir=meta / dc.HF_META
    )
    _assert_same_folder(src, out)
    # asked for float32 files: the model's tensors all float32 (the source's exceptions hold in
    # its own dtype only); the carried ones as the source stores them
    f32 = HFCheckpoint(
        write_hf_folder(
            tmp_path / "f32",
            hf_named_tensors(full, spec, cfg),
            spec,
            source_dir=src,
            dtype=torch.float32,
        )
    )
    model = [k for k in f32.stored_keys() if k not in kept]
    assert {f32.dtype_of(k) for k in model} == {torch.float32}
    source = HFCheckpoint(src)
    assert all(f32.dtype_of(k) == source.dtype_of(k) == torch.bfloat16 for k in kept)
    assert all(torch.equal(f32.get(k), source.get(k).float()) for k in model)


def test_export_without_a_source_is_the_text_layout(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    d = ckpts["dense-conditional-mtp-tied"]
    spec = spec_from_hf_dir(d)
    full = megatron_state_dict_from_hf(d, spec)
    out = write_hf_folder(tmp_path / "text", hf_named_tensors(full, spec), spec)
    cfg, src = _config(out), HFCheckpoint(d)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert spec.mtp_num_layers == 1  # the source's MTP head, which this folder has not
    assert spec_from_hf_config(cfg) == dataclasses.replace(spec, mtp_num_layers=0)
    text = HFCheckpoint(out)
    lm = [k for k in src.stored_keys() if k.startswith("model.language_model.")]
    assert sorted(text.stored_keys()) == sorted(k.replace("language_model.", "") for k in lm)
    assert all(torch.equal(src.get(k), text.get(k.replace("language_model.", ""))) for k in lm)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_config_from_scratch_reads_back_to_the_spec(ckpts):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    for name, config_cls in (("dense", Qwen3_5TextConfig), ("moe", Qwen3_5MoeTextConfig)):
        spec = spec_from_hf_dir(ckpts[name])
        cfg = hf_config_from_spec(spec)
        assert spec_from_hf_config(cfg) == spec
        hf = config_cls(
            **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        )
        assert spec_from_hf_config({**hf.to_dict(), "model_type": cfg["model_type"]}) == spec


# The config.json of a published Qwen3.5-MoE checkpoint (Qwen3.5-35B-A3B's fields, as written by
# transformers 4.57: nested text_config with its own dtype, full_attention_interval beside
# layer_types, interleaved multimodal RoPE, MTP fields, no initializer_range or
# router_aux_loss_coef); its 40 layers and the vision config shortened.
PUBLISHED_MOE = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 248057,
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe"},
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}


def test_a_published_config_is_written_back_unchanged():
    spec = spec_from_hf_config(PUBLISHED_MOE)
    assert spec.params_dtype == torch.bfloat16 and spec.mtp_num_layers == 1
    assert (spec.num_experts, spec.shared_expert_ffn_hidden_size, spec.rotary_percent) == (
        256,
        512,
        0.25,
    )
    assert table_for(spec, PUBLISHED_MOE).hf_names(spec)[0] == (
        "model.language_model.embed_tokens.weight"
    )
    assert hf_config_from_spec(spec, base=PUBLISHED_MOE) == PUBLISHED_MOE
    # a field the spec changes is written where the source keeps it, nothing else moves
    cfg = hf_config_from_spec(dataclasses.replace(spec, rope_theta=5e6), base=PUBLISHED_MOE)
    assert cfg["text_config"]["rope_parameters"]["rope_theta"] == 5e6
    cfg["text_config"]["rope_parameters"]["rope_theta"] = 10000000
    assert cfg == PUBLISHED_MOE


# --- the fused layouts against hand constructions ----------------------------------------


def _labelled(rows: list[float], cols: int = 3) -> torch.Tensor:
    """A [len(rows), cols] tensor whose row i holds rows[i] (+ the column / 10 to tell columns)."""
    return torch.tensor(rows)[:, None] + torch.arange(cols)[None, :] / 10


def test_gated_qkv_layout_by_hand():
    heads, groups, d = 4, 2, 2
    r = heads // groups

    # HF q_proj: per head h, [q_h (d rows); gate_h (d rows)]
    def q(h, i):
        return 100 * h + i

    def gate(h, i):
        return 100 * h + 50 + i

    hf_q = _labelled(
        [v for h in range(heads) for f in (q, gate) for v in (f(h, i) for i in range(d))]
    )
    hf_k = _labelled([1000 + 100 * g + i for g in range(groups) for i in range(d)])
    hf_v = _labelled([2000 + 100 * g + i for g in range(groups) for i in range(d)])
    rows = []
    for g in range(groups):  # megatron: per group [its q heads, its gate heads, k, v]
        rows += [q(g * r + j, i) for j in range(r) for i in range(d)]
        rows += [gate(g * r + j, i) for j in range(r) for i in range(d)]
        rows += [1000 + 100 * g + i for i in range(d)] + [2000 + 100 * g + i for i in range(d)]
    hand = _labelled(rows)
    fused = family_table.merge_gated_qkv(hf_q, hf_k, hf_v, heads, groups, d)
    assert torch.equal(fused, hand)
    # head 2 (group 1)'s gate: HF q_proj rows 10-11 -> megatron rows 16-17 (12 + 2 q heads)
    assert torch.equal(fused[16:18], hf_q[10:12])
    back = family_table.split_gated_qkv(hand, heads, groups, d)
    assert all(torch.equal(x, y) for x, y in zip(back, (hf_q, hf_k, hf_v), strict=True))
    # control: q_proj laid out as [every q head; every gate head] is not what the rule reads
    wrong = _labelled([f(h, i) for f in (q, gate) for h in range(heads) for i in range(d)])
    assert not torch.equal(family_table.merge_gated_qkv(wrong, hf_k, hf_v, heads, groups, d), hand)


def test_gated_qkv_layout_is_transformers_attention():
    """Transformers' Qwen3.5 attention, its q_proj / k_proj / v_proj split from a megatron
    linear_qkv whose gate rows give each head its own gate: each head's output is its group's
    value scaled by sigmoid(its gate), as megatron-core's gated attention computes it."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    heads, groups, d = 4, 2, 4
    r = heads // groups
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    config = Qwen3_5TextConfig(
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=d,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        vocab_size=8,
        rope_parameters=rope,
    )
    config._attn_implementation = "eager"
    attn = Qwen3_5Attention(config, layer_idx=0).eval()
    gates = torch.tensor([-2.0, -0.5, 1.0, 3.0])  # head h's gate
    linear_qkv = torch.zeros(groups * (2 * r + 2) * d, heads * d)
    for g in range(groups):
        base = g * (2 * r + 2) * d
        for j in range(r):
            linear_qkv[base + (r + j) * d : base + (r + j + 1) * d, 0] = gates[g * r + j]
        linear_qkv[base + (2 * r + 1) * d : base + (2 * r + 2) * d, 0] = g + 1.0  # value g + 1
    q, k, v = family_table.split_gated_qkv(linear_qkv, heads, groups, d)
    with torch.no_grad():
        attn.q_proj.weight.copy_(q), attn.k_proj.weight.copy_(k), attn.v_proj.weight.copy_(v)
        attn.o_proj.weight.copy_(torch.eye(heads * d))
        x = torch.zeros(1, 1, heads * d)
        x[..., 0] = 1.0
        cos, sin = torch.ones(1, 1, d // 2), torch.zeros(1, 1, d // 2)
        out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=None)
    want = torch.stack([(h // r + 1) * torch.sigmoid(gates[h]) for h in range(heads)])
    torch.testing.assert_close(out.reshape(heads, d), want[:, None].expand(heads, d))


def test_in_proj_layout_by_hand():
    spec = SimpleNamespace(
        linear_num_key_heads=2,
        linear_key_head_dim=2,
        linear_num_value_heads=4,
        linear_value_head_dim=2,
    )
    kd, vd, nv = 4, 8, 4  # in_proj_qkv: q, k (kd each), v (vd); z (vd); b, a (nv each)
    sizes = {"qkv": 2 * kd + vd, "z": vd, "b": nv, "a": nv}
    labels = {name: [100 * n + i for i in range(sizes[name])] for n, name in enumerate(sizes)}
    parts = [_labelled(labels[name]) for name in sizes]
    # megatron-core's GatedDeltaNet splits in_proj's output as [q, k, v], z, beta, alpha
    hand = _labelled(labels["qkv"] + labels["z"] + labels["b"] + labels["a"])
    fused = family_table.merge_in_proj(*parts, spec)
    assert torch.equal(fused, hand)
    assert torch.equal(fused[2 * kd + 2 * vd : 2 * kd + 2 * vd + nv], parts[2])  # beta's rows
    back = family_table.split_in_proj(hand, spec)
    assert all(torch.equal(x, y) for x, y in zip(back, parts, strict=True))
    # control: b and a exchanged is seen
    assert not torch.equal(
        family_table.merge_in_proj(parts[0], parts[1], parts[3], parts[2], spec), hand
    )


def test_expert_views_and_fusing():
    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    shapes = {"m.mlp.experts.gate_up_proj": (3, 8, 5), "m.mlp.experts.down_proj": (3, 5, 4)}
    views = hf_experts.expert_views(shapes)
    assert len(views) == 9 and views["m.mlp.experts.2.up_proj.weight"] == (
        "m.mlp.experts.gate_up_proj",
        2,
        "up_proj",
    )
    stored = {"m.mlp.experts.gate_up_proj": gate_up, "m.mlp.experts.down_proj": down}
    per = {k: hf_experts.read_view(v, lambda n, e: stored[n][e]) for k, v in views.items()}
    assert torch.equal(per["m.mlp.experts.1.up_proj.weight"], gate_up[1, 4:])
    fused = dict(hf_experts.fuse_experts(per.items(), hf_experts.fused_counts(views)))
    assert fused.keys() == stored.keys() and all(torch.equal(fused[k], stored[k]) for k in stored)
    transposed = {"m.mlp.experts.gate_up_proj": (3, 5, 8), "m.mlp.experts.down_proj": (3, 4, 5)}
    assert hf_experts.expert_views(transposed) == {}
    with pytest.raises(ValueError, match="incomplete"):
        list(hf_experts.fuse_experts(list(per.items())[:-1], hf_experts.fused_counts(views)))


# --- refusals -------------------------------------------------------------------------------


def test_vision_and_mtp_parameters_are_refused_by_name(ckpts):
    spec = spec_from_hf_dir(ckpts["dense-conditional-mtp-tied"])
    table = table_for(spec)
    for name, prefix in (
        ("mtp.layers.0.eh_proj.weight", "mtp"),
        ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight", "mtp"),
        ("vision_model.decoder.layers.0.mlp.linear_fc1.weight", "vision_model"),
    ):
        with pytest.raises(ValueError, match=rf"\({prefix}\.\* parameters\)"):
            table.rule(name)
        with pytest.raises(ValueError, match=rf"{prefix}\."):
            family_table.hf_tensors(table, spec, name, torch.zeros(2))
        with pytest.raises(ValueError, match=rf"{prefix}\."):
            family_table.megatron_tensor(table, spec, name, lambda n: torch.zeros(2))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_configs_are_refused(ckpts, change, match):
    cfg = _config(ckpts["dense-conditional-mtp-tied"])
    cfg["text_config"].update(change)
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(cfg)


def test_moe_config_without_a_shared_expert_is_refused(ckpts):
    cfg = _config(ckpts["moe"])
    del cfg["shared_expert_intermediate_size"]
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        spec_from_hf_config(cfg)


def test_a_stray_language_model_tensor_is_refused(ckpts, tmp_path):
    d = shutil.copytree(ckpts["dense-conditional-mtp-tied"], tmp_path / "stray")
    spec = spec_from_hf_dir(d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["mtp.extra.weight"] = torch.zeros(2)  # carried: fine
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    megatron_state_dict_from_hf(d, spec)
    tensors["model.language_model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected \['model.language_model.layers.0.extra"):
        megatron_state_dict_from_hf(d, spec)


# --- the tiny checkpoints -------------------------------------------------------------------


def test_tiny_model_command_writes_a_folder_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_ba.cli import main

    out = tmp_path / "q35"
    assert main(["tiny-model", str(out), "--family", "qwen3_5"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any(info.values())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 512) and torch.isfinite(logits).all()
    assert ModelShape.from_hf_config(_config(out)) == PRESETS["tiny-qwen3.5"]


def test_tiny_checkpoints_have_the_presets_shapes(ckpts):
    for name, preset in (
        ("dense", "tiny-qwen3.5"),
        ("moe-conditional-mtp-fused", "tiny-qwen3.5-moe"),
    ):
        shape = ModelShape.from_hf_config(_config(ckpts[name]))
        assert shape == ModelShape(
            **{**vars(PRESETS[preset]), "mtp_num_layers": shape.mtp_num_layers}
        )
    assert spec_from_hf_dir(ckpts["moe-conditional-mtp-fused"]).mtp_num_layers == 1
