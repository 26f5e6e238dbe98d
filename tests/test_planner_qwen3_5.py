"""Qwen3.5 in the planner: the hybrid decoder's counts, the presets, the layouts it plans and
refuses, the generation engine's fixed per-sequence state, and the recipe that trains it.

    python -m pytest tests/test_planner_qwen3_5.py -q      # ~15 s: meta-device models, no GPU

* Counts: ModelShape.total_params of a Qwen3.5 shape equals the parameter count of transformers'
  Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM built (on the meta device) from the same config,
  dense and MoE, tied and untied; the presets' counts match the sizes their names give.
* Layouts: `megatron-ba layout --model Qwen3.5-35B-A3B` plans (a preset, and a release-layout
  config.json with its text model under text_config); cp > 1 is planned where the DeltaNet's
  heads split over tp * cp (megatron-core 0.19.2's rule) and refused naming the rule where they
  do not, by the command and by the Slurm launcher's fit check, while a full-attention MoE at
  the same layout is planned (the control).
* Generation: a Gated DeltaNet layer keeps a fixed state per sequence in vLLM, whatever the
  sequence's length; only the full-attention layers' KV cache grows with it (the control: a model
  of full attention only, whose KV cache per sequence grows with the context).
* The recipe recipes/qwen3.5-35b-a3b-dapo17k-16k.yaml loads and translates to verl and NeMo-RL.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from megatron_ba.cli import main as cli_main
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.planning import launch
from megatron_ba.planning.generation_memory import (
    kv_cache_bytes_per_token,
    linear_state_bytes_per_sequence,
    sequence_cache_bytes,
)
from megatron_ba.planning.memory import (
    GIB,
    PRECISION,
    EngineShare,
    MemorySettings,
    estimate,
    layer_activations,
    load_model,
)
from megatron_ba.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/qwen3.5-35b-a3b-dapo17k-16k.yaml"
Q35 = PRESETS["Qwen3.5-35B-A3B"]
SMALL = dict(vocab_size=512, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_key_head_dim=32, linear_conv_kernel_dim=4)  # fmt: skip


def _hf_count(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def _shape(config, model_type: str) -> ModelShape:
    return ModelShape.from_hf_config({**config.to_dict(), "model_type": model_type})


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("value_heads, value_dim", [(4, 32), (8, 16)])
def test_dense_counts_equal_transformers(tie, value_heads, value_dim):
    config = transformers.Qwen3_5TextConfig(
        **SMALL, intermediate_size=256, linear_num_value_heads=value_heads,
        linear_value_head_dim=value_dim, tie_word_embeddings=tie,
    )  # fmt: skip
    shape = _shape(config, "qwen3_5_text")
    assert sum(shape.linear_attention_pattern) == 6  # 3 of every 4 layers Gated DeltaNet
    assert shape.total_params() == _hf_count(transformers.Qwen3_5ForCausalLM, config)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_moe_counts_equal_transformers(tie):
    config = transformers.Qwen3_5MoeTextConfig(
        **SMALL, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_value_head_dim=16,
        tie_word_embeddings=tie,
    )  # fmt: skip
    shape = _shape(config, "qwen3_5_moe_text")
    assert shape.total_params() == _hf_count(transformers.Qwen3_5MoeForCausalLM, config)
    # the control: the same model counted as if every layer were full attention differs
    plain = dataclasses.replace(shape, linear_attention_pattern=None)
    assert plain.total_params() != shape.total_params()


def test_layer_terms_by_hand():
    """A Gated DeltaNet's terms as the brief's formula spells them (35B-A3B: h 2048, Kd 2048,
    Vd 4096, 32 value heads, kernel 4), and a gated full attention's doubled q projection."""
    h, kd, vd, nv = 2048, 16 * 128, 32 * 128, 32
    gdn = h * (2 * kd + 2 * vd + 2 * nv) + (2 * kd + vd) * 4 + 2 * nv + 128 + vd * h
    assert Q35.linear_attention_params() == gdn
    q, kv = 16 * 256, 2 * 256
    assert Q35.attention_params() == 2 * h * q + 2 * h * kv + q * h + 2 * 256
    moe = h * 256 + 3 * h * 512 + h  # router, shared expert and its gate
    assert Q35.layer_dense_params(0) == gdn + moe + 2 * h
    assert Q35.layer_dense_params(3) == Q35.attention_params() + moe + 2 * h


@pytest.mark.parametrize(
    "name, billions, exact",
    [
        ("Qwen3.5-9B", 9, 8_953_803_264),
        ("Qwen3.5-27B", 27, 26_895_998_464),
        ("Qwen3.5-35B-A3B", 35, 34_660_610_688),
        ("Qwen3.5-397B-A17B", 397, 396_346_350_336),
    ],
)
def test_preset_sizes_match_their_names(name, billions, exact):
    """The text model's parameters (no MTP layer, no vision tower) within 2 % of the name."""
    shape = PRESETS[name]
    assert shape.total_params() == exact
    assert abs(exact / 1e9 - billions) / billions < 0.02
    assert shape.has_linear_attention and shape.num_layers % 4 == 0


def _layout(capsys, *args) -> tuple[int, dict | None, str]:
    status = cli_main(["layout", *args, "--json"])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if out.strip() else None), err


# the recipe's cluster and step (its header's `# layout:` call)
CLUSTER = [
    *("--nodes", "4", "--gpus-per-node", "8", "--gpu-mem", "80", "--max-response-len", "16384"),
    *("--prompt-len", "1024", "--group-size", "16", "--prompts-per-step", "128"),
]


def test_the_35b_a3b_preset_is_planned_with_its_terms(capsys):
    status, j, err = _layout(capsys, "--model", "Qwen3.5-35B-A3B", *CLUSTER, "--ep", "8")
    assert status == 0, err
    assert (j["tp"], j["pp"], j["cp"], j["ep"], j["fits"]) == (2, 1, 1, 8, True)
    b = j["breakdown_gib"]
    for term in ("engine_kv_per_sequence", "engine_linear_state_per_sequence",
                 "engine_conv_state_per_sequence", "activations", "weights"):  # fmt: skip
        assert b[term] > 0, term
    assert j["engine_sequences"] >= 1
    assert j["params_billion"] == 34.661


def test_a_release_layout_config_json_is_read_and_planned(tmp_path, capsys):
    """Qwen3.5-35B-A3B's ForConditionalGeneration config.json (transformers' defaults are its
    shape; the text model under text_config) reads back as the preset and is planned."""
    cfg = json.loads(transformers.Qwen3_5MoeConfig().to_json_string())
    cfg["text_config"] |= {"max_position_embeddings": 262144,
                           "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
                           "mtp_num_hidden_layers": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_model(str(tmp_path / "config.json"))
    compare = ("moe_aux_loss_coeff",)  # the router's loss coefficient is no size
    assert dataclasses.replace(shape, name=Q35.name, **{k: 0.0 for k in compare}) == Q35
    status, j, err = _layout(capsys, "--model", str(tmp_path / "config.json"), *CLUSTER,
                             "--ep", "8")  # fmt: skip
    assert status in (0, 1), err
    assert j["breakdown_gib"]["engine_linear_state_per_sequence"] > 0


def test_context_parallelism_splits_the_deltanet_heads_with_tp(capsys):
    """megatron-core 0.19.2's rule: the DeltaNet's key (16) and value (32) heads are multiples
    of tp * cp. tp 2 x cp 2 is planned, its activations half of cp 1's (no recomputation, the
    same sequence: each rank keeps its share of the tokens, or of the heads inside a DeltaNet);
    tp 2 x cp 16 is refused naming --cp and the rule; the control, a model of full attention
    only, is planned at tp 2 x cp 16."""
    pinned = [
        "--ep",
        "8",
        "--tp",
        "2",
        "--pp",
        "1",
        "--recompute",
        "none",
        "--micro-batch-size",
        "1",
    ]
    runs = {}
    for cp in (1, 2):
        status, j, err = _layout(capsys, "--model", "Qwen3.5-35B-A3B", *CLUSTER, *pinned,
                                 "--cp", str(cp))  # fmt: skip
        assert status in (0, 1) and j["cp"] == cp, err
        runs[cp] = j["breakdown_gib"]["activations"]
    assert abs(runs[2] / runs[1] - 0.5) < 1e-3, runs
    status, _, err = _layout(capsys, "--model", "Qwen3.5-35B-A3B", *CLUSTER, *pinned,
                             "--cp", "16")  # fmt: skip
    assert status == 2
    assert "--cp: linear_num_key_heads=16 is not a multiple of tp*cp=2*16" in err, err
    status, j, err = _layout(capsys, "--model", "Qwen3-30B-A3B", *CLUSTER, *pinned,
                             "--cp", "16")  # fmt: skip
    assert status in (0, 1) and j["cp"] == 16, err


def test_the_launcher_refuses_cp_under_the_recipe_key(tmp_path, capsys):
    cfg = json.loads(transformers.Qwen3_5MoeConfig().to_json_string())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fit = ["fit", str(RECIPE), f"model.pretrained={tmp_path}", "--nodes", "4",
           "--gpus-per-node", "8", "--gpu-mem", "80"]  # fmt: skip
    assert launch.main(fit) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert launch.main([*fit, "parallel.cp=16"]) == 2
    err = capsys.readouterr().err
    assert "parallel.cp: linear_num_key_heads=16 is not a multiple of tp*cp=2*16" in err, err


def _generation(shape, seq_len, tp=2):
    layout = ParallelLayout(tp=tp, dp=4, ep=8 if shape.is_moe else 1, etp=1,
                            sequence_parallel=tp > 1)  # fmt: skip
    step = MemorySettings(seq_len, recompute="full")
    return estimate(shape, layout, step, gpu_mem_gib=80, vllm=EngineShare(0.6, tp=tp),
                    seq_len=seq_len)  # fmt: skip


def test_the_engine_state_scales_with_sequences_not_context():
    """A Gated DeltaNet's state is per sequence (the same at 4K and 32K tokens); its
    full-attention layers' KV cache grows with the tokens; the sequences the cache holds are the
    pool over both. The control: Qwen3-30B-A3B (full attention only) has no fixed state."""
    short, long = _generation(Q35, 4096), _generation(Q35, 32768)
    assert short.engine_linear_state_per_sequence == long.engine_linear_state_per_sequence > 0
    assert short.engine_conv_state_per_sequence == long.engine_conv_state_per_sequence > 0
    assert long.engine_kv_per_sequence == 8 * short.engine_kv_per_sequence
    per_seq = long.engine_kv_per_sequence + long.engine_linear_state_per_sequence
    per_seq += long.engine_conv_state_per_sequence
    assert long.engine_sequences == int(long.vllm_kv_cache // per_seq)
    assert short.engine_sequences > long.engine_sequences
    control = PRESETS["Qwen3-30B-A3B"]
    c_short, c_long = _generation(control, 4096), _generation(control, 32768)
    assert c_short.engine_linear_state_per_sequence == 0 == c_long.engine_conv_state_per_sequence
    assert c_long.engine_kv_per_sequence == 8 * c_short.engine_kv_per_sequence > 0


def test_engine_state_by_hand():
    """vLLM's shapes (gated_delta_net_state_shape) at TP 2: the recurrent state 16 value heads x
    128 x 128 in fp32, the conv state (2 x 2048 + 4096) / 2 channels x 3 in bf16, in 30 layers;
    keys and values of the 10 full-attention layers only (one of the 2 KV heads per GPU)."""
    recurrent, conv = linear_state_bytes_per_sequence(Q35, 2)
    assert recurrent == 30 * 16 * 128 * 128 * 4
    assert conv == 30 * 4096 * 3 * 2
    assert kv_cache_bytes_per_token(Q35, 2) == 2 * 10 * 1 * 256 * 2
    assert sequence_cache_bytes(Q35, 2, 1000) == 1000 * 10240 + recurrent + conv
    assert linear_state_bytes_per_sequence(PRESETS["Qwen3-30B-A3B"], 2) == (0.0, 0.0)


def test_training_activations_take_each_layer_by_its_type():
    """No recompute: the stage's layers summed by type (30 Gated DeltaNet, 10 full attention);
    full recompute redoes the largest layer. A Gated DeltaNet layer keeps more per token than a
    gated full-attention layer (no S x S scores in either)."""
    layout = ParallelLayout(tp=2, dp=16, ep=8, etp=1, sequence_parallel=True)
    tokens = 8192
    e = estimate(Q35, layout, MemorySettings(tokens, step_tokens=16 * tokens), gpu_mem_gib=80)
    gdn = layer_activations(Q35, layout, PRECISION, tokens, 0)
    attn = layer_activations(Q35, layout, PRECISION, tokens, 3)
    assert gdn > attn
    assert e.activations_no_recompute == pytest.approx(30 * gdn + 10 * attn)
    full = MemorySettings(tokens, recompute="full", step_tokens=16 * tokens)
    e = estimate(Q35, layout, full, gpu_mem_gib=80)
    kept = 40 * 2048 * 2 * tokens / 2
    assert e.activations_full_recompute == pytest.approx(kept + gdn)
    assert e.activations_full_recompute / GIB < 2


def test_the_recipe_loads_and_translates(tmp_path, capsys):
    recipe = load_recipe(RECIPE)
    layout = recipe.parallel.layout()
    assert (layout.tp, layout.cp, layout.ep, recipe.rollout.engine_tp) == (2, 1, 8, 2)
    from megatron_ba.commands import train

    base = [str(RECIPE), "model.pretrained=/path/to/Qwen3.5-35B-A3B"]
    engines = {
        "verl": ["backend=verl", "data.path=/data/dapo-math-17k.parquet",
                 "eval.data_dir=/data/bench"],
        "nemo_rl": ["backend=nemo_rl", "eval.samples=1", "eval.data_dir=/data/bench",
                    "eval.benchmarks=math500,aime24,aime25,olympiad,minerva"],
    }  # fmt: skip
    expect = {
        "verl": "actor_rollout_ref.actor.megatron.context_parallel_size=1",
        "nemo_rl": "policy.megatron_cfg.context_parallel_size=1",
    }
    for engine, args in engines.items():
        parser = train.argparse.ArgumentParser()
        train.add_arguments(parser)
        flags = ["--print-overrides", "--run-dir", str(tmp_path / engine)]
        status = train.run(parser.parse_args([*base, *args, *flags]))
        out, err = capsys.readouterr()
        assert status in (0, None), err
        assert expect[engine] in out.splitlines(), engine
