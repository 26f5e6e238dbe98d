"""The log-prob pass (planning/logprob_memory.py), NeMo-RL's offload around its refit
(generation_memory.trainer_kept) and the launcher's --headroom, against hand computations.

    python -m pytest tests/test_planner_logprob.py -q

The model is Qwen2.5-1.5B (the preset "qwen2.5-1.5b": h 1536, 28 layers, 12 heads of 128, 2 KV
heads, MLP 8960, vocabulary 151936, tied embeddings).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ba.cli import main as cli_main
from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.planning import launch
from megatron_ba.planning.generation_memory import EngineShare
from megatron_ba.planning.logprob_memory import LOGPROB_FORWARD_BYTES, logprob_tokens
from megatron_ba.planning.memory import PRECISION, MemorySettings, estimate, layer_activations

ROOT = Path(__file__).resolve().parents[1]
Q15 = PRESETS["qwen2.5-1.5b"]
V = 151936
LAYOUT = ParallelLayout(1, 1, 1, 8)
STEP = MemorySettings(4096, logprobs="fp32", grad_reduce="bf16")


def test_log_prob_pass_by_hand():
    """16,384 tokens of NeMo-RL's fp32 path: three fp32 tensors of the logits (12 bytes each
    logit), beside the weights and the optimiser (no engine: NeMo-RL's prepare_for_lp_inference
    moves only the gradients off) and one layer's activations; no pass, no term."""
    assert logprob_tokens(4, 4096) == 16384 and logprob_tokens(None, 4096) is None
    assert LOGPROB_FORWARD_BYTES["fp32"] == 3 * 4
    base = estimate(Q15, LAYOUT, STEP, gpu_mem_gib=79.11)
    assert base.logprob_phase == 0 and base.logprob_logits == 0 and base.peak_phase == "train"
    e = estimate(Q15, LAYOUT, replace(STEP, logprob_tokens=16384), gpu_mem_gib=79.11)
    logits = 16384 * V * 12
    assert e.logprob_logits == pytest.approx(logits)
    layer = layer_activations(Q15, LAYOUT, PRECISION, 16384)
    assert e.logprob_phase == pytest.approx(e.weights + e.optimizer + layer + logits)
    assert e.train_phase == pytest.approx(base.train_phase)  # training is unchanged
    assert e.peak_phase == "logprob" and e.peak == pytest.approx(e.logprob_phase)
    # CP splits the pass's tokens; TP its vocabulary
    lo = ParallelLayout(2, 1, 2, 2, sequence_parallel=True)
    e2 = estimate(Q15, lo, replace(STEP, logprob_tokens=16384), gpu_mem_gib=79.11)
    assert e2.logprob_logits == pytest.approx(16384 / 2 * V / 2 * 12)


def test_nemo_rl_refit_offload_keeps_nothing_beside_vllm():
    """offload "states" (NeMo-RL's offload_before_refit + offload_after_refit): generation holds
    the pool alone, the refit's instant the weights, the log-prob pass the weights; "auto" keeps
    the weights beside the sleeping engine in all three."""
    vllm = EngineShare(0.6, refit_bucket_mb=0, refit_before_kv=True)
    step = replace(STEP, logprob_tokens=4096)
    states = estimate(Q15, LAYOUT, replace(step, offload="states"), gpu_mem_gib=79.11, vllm=vllm)
    auto = estimate(Q15, LAYOUT, step, gpu_mem_gib=79.11, vllm=vllm)
    assert states.generate_phase == pytest.approx(0.6 * 79.11 * 2**30)
    assert auto.generate_phase == pytest.approx(states.generate_phase + auto.weights)
    assert states.refit_phase == pytest.approx(
        states.weights + states.engine_weights + states.refit_full_param
    )
    layer = layer_activations(Q15, LAYOUT, PRECISION, 4096)
    assert states.logprob_phase == pytest.approx(states.weights + layer + 4096 * V * 12)
    assert auto.logprob_phase == pytest.approx(states.logprob_phase)


def test_logprob_batch_size_flag(capsys):
    args = ["layout", "--model", "qwen2.5-1.5b", "--nodes", "1", "--gpus-per-node", "8", "--gpu",
            "H100", "--seq-len", "4096", "--tp", "1", "--micro-batch-size", "1", "--logprobs",
            "fp32", "--json"]  # fmt: skip
    assert cli_main([*args, "--logprob-batch-size", "4"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["logprob_tokens"] == 16384 and j["peak_phase"] in ("train", "generate", "logprob")
    assert j["breakdown_gib"]["logprob_logits"] == pytest.approx(16384 * V * 12 / 2**30, abs=1e-3)
    assert cli_main(args) == 0
    assert json.loads(capsys.readouterr().out)["logprob_tokens"] is None
    assert cli_main([*args, "--logprob-batch-size", "0"]) == 2
    assert "--logprob-batch-size: must be >= 1" in capsys.readouterr().err
    assert cli_main([*args[:-1], "--logprob-batch-size", "2"]) == 0
    assert "log-prob pass (8192 tokens per micro-batch)" in capsys.readouterr().out


def test_launcher_headroom(tmp_path, capsys):
    """The launcher's --headroom is the verdict's (planning.verdict.assess): the shipped 32B
    recipe fits at the default and not when its tensors must leave half the GPU free; a headroom
    outside [0, 1) is a bad input (exit 2)."""
    s = PRESETS["Qwen2.5-32B"]
    cfg = {"model_type": "qwen2", "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
           "num_attention_heads": s.num_attention_heads, "intermediate_size": s.ffn_hidden_size,
           "num_key_value_heads": s.num_query_groups, "vocab_size": s.vocab_size}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    recipe = str(ROOT / "recipes/qwen2.5-32b-dapo17k-16k.yaml")
    fit = ["fit", recipe, f"model.pretrained={tmp_path}", "--nodes", "4", "--gpus-per-node", "8",
           "--gpu-mem", "80"]  # fmt: skip
    assert launch.main(fit) == 0
    capsys.readouterr()
    assert launch.main([*fit, "--headroom", "0.5"]) == launch.FIT_EXIT
    assert "the headroom of 0.5 leaves" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        launch.main([*fit, "--headroom", "1.5"])
    assert bad.value.code == 2 and "--headroom: must be in [0, 1)" in capsys.readouterr().err
