"""HF Qwen2 / Qwen3 <-> megatron-core conversion: tables, fused layouts, configs, file I/O.

In-process and fast (no megatron-core parallel state); the model-level checks (log-probs of
transformers vs megatron-core vs vLLM at TP=1/2, the convert command) are in
test_conversion_megatron.py. Checkpoints are tiny random models built with transformers here.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ba.conversion import (
    HFCheckpoint,
    family_table,
    hf_config_from_spec,
    hf_named_tensors,
    megatron_state_dict_from_hf,
    spec_from_hf_config,
    spec_from_hf_dir,
    table_for,
    write_hf_folder,
    write_safetensors,
)
from megatron_ba.megatron.model import ModelSpec, full_parameter_shapes

VARIANTS = ("qwen2-tied", "qwen2-untied", "qwen3")


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def build_tiny(root, name: str, dtype=torch.float32):
    """A tiny random HF checkpoint of one variant, saved with save_pretrained (norms and biases
    perturbed so that a swapped tensor changes the model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=512,  # the size of testing.tiny_hf.build_tokenizer(512)
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        eos_token_id=2,
        bos_token_id=0,
    )
    if name == "qwen3":
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(hidden_size=64, head_dim=32, **common)
    else:
        tied = name == "qwen2-tied"
        cls, cfg = (
            Qwen2ForCausalLM,
            Qwen2Config(hidden_size=128, tie_word_embeddings=tied, **common),
        )
    torch.manual_seed(0)
    model = cls(cfg).to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = root / f"{name}-{str(dtype).split('.')[-1]}"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {v: build_tiny(root, v) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_megatron_hf_is_bit_identical(ckpts, variant):
    ckpt = HFCheckpoint(ckpts[variant])
    spec = spec_from_hf_dir(ckpts[variant])
    full = megatron_state_dict_from_hf(ckpts[variant], spec)
    # The table's megatron names and shapes are exactly the model builder's.
    assert {k: tuple(v.shape) for k, v in full.items()} == full_parameter_shapes(spec)
    back = dict(hf_named_tensors(full, spec))
    assert set(back) == set(ckpt.keys())
    for k in ckpt.keys():
        a = ckpt.get(k)
        assert back[k].dtype == a.dtype and torch.equal(back[k], a), k


def test_spec_fields_from_configs(ckpts):
    q2 = spec_from_hf_dir(ckpts["qwen2-tied"])
    assert (q2.family, q2.qkv_bias, q2.qk_layernorm, q2.tie_word_embeddings) == (
        "qwen2",
        True,
        False,
        True,
    )
    assert q2.kv_channels is None and q2.head_dim == 32
    q3 = spec_from_hf_dir(ckpts["qwen3"])
    assert (q3.family, q3.qkv_bias, q3.qk_layernorm, q3.tie_word_embeddings) == (
        "qwen3",
        False,
        True,
        False,
    )
    # head_dim 32 with hidden 64 / 4 heads = 16: the explicit head_dim wins (megatron kv_channels).
    assert q3.kv_channels == 32 and q3.head_dim == 32 and q3.hidden_size // 4 == 16
    assert q3.rope_theta == 10000.0 and q3.params_dtype == torch.float32
    assert spec_from_hf_dir(ckpts["qwen2-untied"]).tie_word_embeddings is False


def test_bfloat16_checkpoint_round_trips_in_its_dtype(tmp_path):
    d = build_tiny(tmp_path, "qwen3", torch.bfloat16)
    spec = spec_from_hf_dir(d)
    assert spec.params_dtype == torch.bfloat16
    full = megatron_state_dict_from_hf(d, spec)
    out = write_hf_folder(tmp_path / "out", hf_named_tensors(full, spec), spec, source_dir=d)
    a, b = HFCheckpoint(d), HFCheckpoint(out)
    assert all(
        b.get(k).dtype == torch.bfloat16 and torch.equal(a.get(k), b.get(k)) for k in a.keys()
    )
    assert json.loads((out / "config.json").read_text()) == a.config()


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_from_spec_reproduces_the_source(ckpts, variant):
    src = HFCheckpoint(ckpts[variant]).config()
    spec = spec_from_hf_config(src)
    assert hf_config_from_spec(spec, base=src) == src
    # From scratch (no base): every field the spec determines equals the source's.
    fresh = hf_config_from_spec(spec)
    for key in (
        "architectures",
        "model_type",
        "hidden_size",
        "num_key_value_heads",
        "intermediate_size",
        "tie_word_embeddings",
        "rms_norm_eps",
        "rope_parameters",
    ):
        assert fresh[key] == src[key], key
    assert fresh["rope_theta"] == src["rope_parameters"]["rope_theta"]
    from transformers import AutoConfig

    # transformers reads the from-scratch config back to the same architecture.
    path = ckpts[variant].parent / f"{variant}-fresh"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(fresh))
    assert spec_from_hf_config(AutoConfig.from_pretrained(path).to_dict()) == spec


def test_fused_qkv_layout_by_hand():
    # 4 q heads in 2 groups, head_dim 1: megatron rows per group are [q, q, k, v].
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = family_table.merge_qkv(q, k, v, heads=4, groups=2, head_dim=1)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = family_table.split_qkv(fused, heads=4, groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    # A naive [all q; all k; all v] reading of the fused tensor is a different split.
    assert not torch.equal(fused[:4], q)
    gate, up = torch.ones(3, 2), 2 * torch.ones(3, 2)
    assert torch.equal(family_table.split_gated(family_table.merge_gated(gate, up))[0], gate)


def test_transformer_engine_spellings_map_to_the_same_hf_names():
    spec = ModelSpec(
        64, 64, 1, 4, 2, 32, family="qwen3", qk_layernorm=True, qkv_bias=False, kv_channels=32
    )
    table = table_for(spec)
    te = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    }
    for name, hf in te.items():
        assert table.hf_names_of(name) == [f"model.layers.0.{hf}"]
    assert (
        family_table.hf_tensors(table, spec, "decoder.layers.0.mlp.linear_fc1._extra_state", None)
        == []
    )
    with pytest.raises(KeyError, match=r"linear_qkv\.bias"):
        table.rule("decoder.layers.0.self_attention.linear_qkv.bias")  # Qwen3 has no QKV bias


def test_qwen2spec_name_still_builds_the_qwen2_shape():
    spec = ModelSpec(16, 64, 2, 4, 2, 32)
    assert (
        spec.family == "qwen2"
        and spec.head_dim == 16
        and "output_layer.weight" in (full_parameter_shapes(spec))
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "llama"}, "model_type"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            "rope_parameters.rope_type 'llama3'",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_theta": 5.0}, "disagrees"),
    ],
)
def test_bad_configs_are_refused_by_name(ckpts, change, match):
    cfg = HFCheckpoint(ckpts["qwen2-untied"]).config()
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(cfg)


def test_qwen3_attention_bias_is_refused(ckpts):
    cfg = HFCheckpoint(ckpts["qwen3"]).config() | {"attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias"):
        spec_from_hf_config(cfg)


def test_missing_and_unexpected_tensors_are_named(ckpts, tmp_path):
    from safetensors.torch import load_file

    src = ckpts["qwen2-untied"]
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    write_safetensors(tmp_path, tensors.items())
    spec = spec_from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        megatron_state_dict_from_hf(tmp_path, spec)


def test_sharded_write_and_read(ckpts, tmp_path):
    src = HFCheckpoint(ckpts["qwen2-untied"])
    named = [(k, src.get(k)) for k in src.keys()]
    files = write_safetensors(tmp_path, named, max_shard_bytes=64 * 1024)
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "config.json").write_text((ckpts["qwen2-untied"] / "config.json").read_text())
    back = HFCheckpoint(tmp_path)
    assert set(back.keys()) == set(src.keys())
    assert all(torch.equal(back.get(k), src.get(k)) for k in src.keys())
    # A later single-file write into the same folder leaves no stale shard or index behind.
    write_safetensors(tmp_path, named[:3])
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert set(HFCheckpoint(tmp_path).keys()) == {k for k, _ in named[:3]}
