"""RoPE scaling settings: read from both config.json forms, refused by name, written back.

Pure Python and config dicts (no weights, no megatron-core model): the logits check against
transformers is tests/test_rope_yarn.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ba.conversion import hf_config_from_spec, spec_from_hf_config
from megatron_ba.conversion.dist_checkpoint import spec_from_json, spec_to_json
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.rope_scaling import RopeScaling, rope_scaling_from_hf

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def qwen3_config(**changes) -> dict:
    """A small Qwen3 config.json in transformers 5's form (rope_parameters), plain RoPE."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "dtype": "float32",
    }
    cfg.update(changes)
    return cfg


def test_both_forms_read_to_the_same_settings():
    new = qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1e6})
    old = qwen3_config(rope_theta=1e6, rope_scaling={**QWEN3_YARN, "type": "yarn"})
    del old["rope_parameters"]
    want = RopeScaling(factor=4.0, original_max_position_embeddings=32768)
    assert rope_scaling_from_hf(new) == rope_scaling_from_hf(old) == want
    assert spec_from_hf_config(new) == spec_from_hf_config(old)
    assert spec_from_hf_config(new).rope_scaling == want
    assert rope_scaling_from_hf(qwen3_config()) is None
    # transformers: original_max_position_embeddings defaults to max_position_embeddings
    short = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}
    assert rope_scaling_from_hf(qwen3_config(rope_parameters=short)).max_context == 81920


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dyn"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}},
            "rope_parameters.rope_type 'longrope'",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
        (
            {"rope_parameters": {**QWEN3_YARN, "rope_theta": 1e6, "mscale": 0.7}},
            r"rope_parameters.mscale 0.7",
        ),
        (
            {"rope_parameters": {**QWEN3_YARN, "rope_theta": 1e6, "attention_factor": 1.0}},
            "rope_parameters.attention_factor",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters.factor"),
        ({"rope_scaling": QWEN3_YARN}, "disagree"),  # beside a plain rope_parameters
        (
            {"rope_parameters": {**QWEN3_YARN, "rope_theta": 1e6, "factor": 0.5}},
            "rope_scaling.factor",
        ),
    ],
)
def test_rope_types_and_keys_not_built_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(qwen3_config(**change))


def test_config_written_from_scratch_has_both_forms_and_transformers_reads_yarn(tmp_path):
    from transformers import AutoConfig

    spec = spec_from_hf_config(qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1e6}))
    fresh = hf_config_from_spec(spec)
    assert fresh["rope_parameters"] == {**QWEN3_YARN, "rope_theta": 1e6}
    assert fresh["rope_scaling"] == QWEN3_YARN and fresh["rope_theta"] == 1e6
    (tmp_path / "config.json").write_text(json.dumps(fresh))
    read = AutoConfig.from_pretrained(tmp_path)
    assert {k: read.rope_parameters[k] for k in QWEN3_YARN} == QWEN3_YARN
    assert spec_from_hf_config(read.to_dict()) == spec
    # dropping the scaling from the spec writes plain RoPE over the source's YaRN
    plain = hf_config_from_spec(spec.of(spec, rope_scaling=None), base=fresh)
    assert plain["rope_parameters"]["rope_type"] == "default" and plain["rope_scaling"] is None
    assert spec_from_hf_config(plain).rope_scaling is None


def test_spec_json_and_shape_carry_the_scaling():
    cfg = qwen3_config(rope_scaling=QWEN3_YARN, rope_parameters=None, rope_theta=1e6)
    spec = spec_from_hf_config(cfg)
    back = spec_from_json(json.loads(json.dumps(spec_to_json(spec))))
    assert back == spec and isinstance(back.rope_scaling, RopeScaling)
    # memory and parameter counts do not change with YaRN; the context does
    plain = PRESETS["Qwen3-32B"]
    yarn = dataclasses.replace(
        plain, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768}
    )
    assert yarn.total_params() == plain.total_params()
    assert yarn.layer_activation_elements() == plain.layer_activation_elements()
    assert (plain.max_context, yarn.max_context) == (4096, 131072)
    shape = ModelShape.from_hf_config(qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1}))
    assert shape.rope_scaling.factor == 4.0 and shape.max_context == 131072
    # the planner still estimates a model whose rope type is not built here (no context check)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    assert ModelShape.from_hf_config(qwen3_config(rope_parameters=llama3)).rope_scaling is None


RECIPE = "recipes/qwen3-32b-dapo17k-64k.yaml"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.rope_scaling.type=llama3", r"^model\.rope_scaling\.type: 'llama3' is not built"),
        ("model.rope_scaling.factor=0.5", r"^model\.rope_scaling\.factor: yarn: >= 1"),
        ("model.rope_scaling.original_max_position_embeddings=null", r"original_max_position"),
        ("grpo.max_new_tokens=64513", r"^grpo\.max_new_tokens: 64513 \+ data\.max_prompt_tokens"),
    ],
)
def test_recipe_rope_scaling_keys_are_checked_by_name(override, message):
    from megatron_ba.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe(RECIPE, [override])


def test_recipe_yarn_needs_a_checkpoint_and_type():
    from megatron_ba.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"^model\.rope_scaling\.factor: needs type: yarn"):
        load_recipe("recipes/tiny-cpu.yaml", ["model.rope_scaling.factor=2"])
    yarn = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=2"]
    yarn.append("model.rope_scaling.original_max_position_embeddings=128")
    with pytest.raises(RecipeError, match=r"yarn needs model\.pretrained"):
        load_recipe("recipes/tiny-cpu.yaml", yarn)


def test_run_refuses_a_checkpoint_without_the_recipes_yarn(tmp_path):
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.policy import check_shape_keys

    recipe = load_recipe(RECIPE)
    with_yarn = spec_from_hf_config(qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1e6}))
    with pytest.raises(ValueError, match=r"^model\.rope_scaling: the recipe says .*factor': 2\.0"):
        check_shape_keys(recipe, with_yarn, tmp_path)  # factor 4 in config.json, 2 in the recipe
    with pytest.raises(ValueError, match=r"config\.json says plain RoPE"):
        check_shape_keys(recipe, spec_from_hf_config(qwen3_config()), tmp_path)
    two = {**QWEN3_YARN, "factor": 2.0, "rope_theta": 1e6}
    check_shape_keys(recipe, spec_from_hf_config(qwen3_config(rope_parameters=two)), tmp_path)


def _layout(capsys, *extra) -> tuple[int, str]:
    import argparse

    from megatron_ba.commands.layout import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--model", "qwen3-32b", "--nodes", "8", "--gpus-per-node", "8", "--gpu-mem", "80"]
    code = run(p.parse_args([*base, *extra, "--json"]))
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


def test_planner_yarn_changes_the_context_not_the_memory(capsys):
    code, plain = _layout(capsys, "--seq-len", "65536")
    assert code == 0
    code, yarn = _layout(capsys, "--seq-len", "65536", "--yarn", "2,32768")
    assert code == 0
    plain, yarn = json.loads(plain), json.loads(yarn)
    assert yarn["max_context"] == 65536 and yarn["rope_scaling"]["factor"] == 2.0
    assert yarn["memory_gib_per_gpu"] == plain["memory_gib_per_gpu"]
    assert yarn["overrides"] == plain["overrides"]
    code, err = _layout(capsys, "--seq-len", "131072", "--yarn", "2,32768")
    assert code == 2 and "131072 tokens exceed the model's context 65536" in err
    code, err = _layout(capsys, "--seq-len", "1024", "--yarn", "2")
    assert code == 2 and "--yarn 2: FACTOR,ORIGINAL" in err


def test_yarn_at_context_parallelism_is_refused_where_megatron_core_would_slice_wrongly(
    monkeypatch,
):
    import types

    pytest.importorskip("megatron.core")
    import torch
    from megatron.core import parallel_state

    from megatron_ba.megatron import rope

    spec = spec_from_hf_config(qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1e6}))
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    whole = types.SimpleNamespace(cp=types.SimpleNamespace(size=lambda: 1))  # cp_mode "loss"
    with pytest.raises(ValueError, match=r"^parallel\.cp: a YaRN model at cp=2 runs its context"):
        rope.check_cp(spec, whole)
    rope.check_cp(spec.of(spec, rope_scaling=None), whole)  # plain RoPE takes the model's group
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^parallel\.cp: a YaRN model at cp=2 needs CUDA"):
            rope.check_cp(spec, None)


def test_yarn_config_fields_match_transformers_default_attention_factor():
    import math
    import types

    from megatron_ba.megatron import rope

    spec = spec_from_hf_config(qwen3_config(rope_parameters={**QWEN3_YARN, "rope_theta": 1e6}))
    assert rope.config_defaults(spec) == {"apply_rope_fusion": False}
    assert rope.gpt_model_kwargs(spec) == {"position_embedding_type": "yarn", "rotary_base": 10**6}
    config = types.SimpleNamespace(apply_rope_fusion=False)
    rope.set_yarn_fields(config, spec)
    assert (config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings) == (
        4.0,
        32768,
    )
    # megatron-core's concentration factor with these fields is transformers' 0.1 ln f + 1
    concentration = pytest.importorskip(
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"
    )._yarn_get_concentration_factor_from_config(config)
    assert concentration == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-15)
    with pytest.raises(ValueError, match=r"^apply_rope_fusion: must be false for a YaRN model"):
        rope.set_yarn_fields(types.SimpleNamespace(apply_rope_fusion=True), spec)
