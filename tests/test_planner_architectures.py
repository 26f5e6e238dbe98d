"""The planner refuses, by name, architectures its memory model does not describe
(megatron_ba/planning/architectures.py), through `megatron-ba layout` as users run it:
DeepSeek-V3 (multi-head latent attention; read as plain attention its config counts 706.7 B
parameters for a 671 B model), Qwen3-Next (linear-attention layers outside Qwen3.5, which is
modelled: tests/test_planner_qwen3_5.py), a model type it does not know. Controls: the same
configs without the one property are planned, and a nested text_config is read only for Qwen3.5.
The Slurm launcher's fit check skips its memory check for such a model, saying why, instead of
refusing the launch."""

from __future__ import annotations

import json

import pytest
import transformers

from megatron_ba.cli import main as cli_main
from megatron_ba.planning.architectures import Unmodelled
from megatron_ba.planning.memory import load_model

# The configs as transformers writes them (save_pretrained of its own config types, whose defaults
# are the released models' shapes): DeepSeek-V3 (61 layers, kv_lora_rank 512, 3 dense layers
# first), Qwen3-Next (48 layers, 3 of every 4 Gated DeltaNet) and Qwen3.5-35B-A3B's
# ForConditionalGeneration layout (its text model under text_config, 40 layers, 3 of every 4
# Gated DeltaNet).
DEEPSEEK_V3 = json.loads(transformers.DeepseekV3Config().to_json_string())
QWEN3_NEXT = json.loads(transformers.Qwen3NextConfig().to_json_string())
QWEN3_5_MOE = json.loads(transformers.Qwen3_5MoeConfig().to_json_string())
# Qwen/Qwen3-8B's config.json, the keys the planner reads
QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "vocab_size": 151936,
}  # fmt: skip


def _layout(tmp_path, cfg: dict, capsys) -> tuple[int, str]:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["layout", "--model-config", str(tmp_path), "--nodes", "4", "--gpus-per-node", "8",
            "--gpu", "H100", "--seq-len", "4096", "--json"]  # fmt: skip
    status = cli_main(args)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "cfg, said",
    [
        (DEEPSEEK_V3, "model_type 'deepseek_v3' has multi-head latent attention (kv_lora_rank "
                      "512)"),
        (QWEN3_NEXT, "model_type 'qwen3_next' has linear-attention layers (36 of its 48 "
                     "layers are 'linear_attention'"),
        ({**QWEN3_8B, "model_type": "gemma3_text"}, "model_type 'gemma3_text' is not one the "
                                                    "planner models (qwen2, qwen2_moe, qwen3"),
    ],
    ids=["mla", "linear-attention", "unknown-type"],
)  # fmt: skip
def test_an_architecture_the_planner_does_not_model_is_refused_by_name(cfg, said, tmp_path, capsys):
    status, err = _layout(tmp_path, cfg, capsys)
    assert status == 2, err
    assert said in err, err
    assert "which the planner does not model" in err or "is not one the planner models" in err


def test_the_controls_differ_in_the_one_property_and_are_planned(tmp_path, capsys):
    """Each refused config's reason removed alone: then the planner reads it (and the plain Qwen3
    config is planned through the CLI)."""
    assert _layout(tmp_path, QWEN3_8B, capsys)[0] == 0
    mla_off = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("kv_lora_rank", "q_lora_rank")}
    with pytest.raises(Unmodelled, match="3 dense layers before its expert layers"):
        load_model(_write(tmp_path, mla_off))  # the next thing it does not model: named too
    text = {k: v for k, v in QWEN3_NEXT.items()
            if k != "layer_types" and not k.startswith("linear_")}  # fmt: skip
    text.update(model_type="qwen3_moe")
    assert load_model(_write(tmp_path, text)).num_layers == 48
    # a nested text model is read for Qwen3.5, and for no other model type
    qwen3_5 = load_model(_write(tmp_path, QWEN3_5_MOE))
    assert qwen3_5.num_layers == 40 and sum(qwen3_5.linear_attention_pattern) == 30
    with pytest.raises(Unmodelled, match="nests its text model under text_config"):
        load_model(_write(tmp_path, {**QWEN3_5_MOE, "model_type": "qwen3_vl_moe",
                                     "text_config": text}))  # fmt: skip
    assert load_model(_write(tmp_path, {**QWEN3_8B, "model_type": "llama"})).num_layers == 36


def _write(tmp_path, cfg: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


def test_the_launcher_skips_its_memory_check_for_such_a_model_saying_why(tmp_path, capsys):
    """A recipe whose checkpoint the planner does not model still launches (the engine may
    train it): the fit check says its memory check is skipped and why. Control: the same recipe
    on a Qwen3 checkpoint gets the memory check, here refusing a layout that does not fit."""
    from pathlib import Path

    from megatron_ba.planning import launch

    recipe = str(Path(__file__).resolve().parents[1] / "recipes/qwen3-1.7b-dapo17k.yaml")
    fit = ["fit", recipe, f"model.pretrained={tmp_path}", "--nodes", "1", "--gpus-per-node", "8",
           "--gpu-mem", "8"]  # fmt: skip
    _write(tmp_path, DEEPSEEK_V3)
    assert launch.main(fit) == 0
    err = capsys.readouterr().err
    assert "launch: the memory check is skipped: --model " in err
    assert "multi-head latent attention" in err
    _write(tmp_path, QWEN3_8B)
    assert launch.main(fit) == launch.FIT_EXIT  # 8 GiB GPUs: the control is checked and refused
    assert "does not fit GPUs of 8.0 GiB" in capsys.readouterr().err
