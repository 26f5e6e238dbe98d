"""The planner's phase terms against hand computations: the gradient buffer's dtype, 1F1B's
in-flight micro-batches, and the generation phase's engine terms (the refit's bucket and full
tensor, the engine's own process, vLLM's and SGLang's keys); each flag refused by name; and a
control for each term showing it moves the estimate by exactly its size.

    python -m pytest tests/test_planner_phases.py -q

The model is Qwen2.5-1.5B (the preset "qwen2.5-1.5b": h 1536, 28 layers, 12 heads of 128, 2 KV
heads, MLP 8960, vocabulary 151936, tied embeddings), its figures written out by hand below.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_ba.cli import main as cli_main
from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.planning.generation_memory import (
    ENGINE_PROCESS_GIB,
    EngineShare,
    generation_terms,
    largest_full_tensor,
)
from megatron_ba.planning.memory import (
    FRAGMENTATION,
    GIB,
    NON_TORCH_GIB,
    MemorySettings,
    estimate,
    in_flight_tokens,
)
from megatron_ba.planning.verdict import assess

Q15 = PRESETS["qwen2.5-1.5b"]
LAYER = (
    1536 * 1536  # q
    + 2 * 1536 * 256  # k, v (2 KV heads x 128)
    + 1536 * 1536  # o
    + 1536
    + 2 * 256  # q, k, v biases
    + 3 * 1536 * 8960  # gate, up, down
    + 2 * 1536  # two RMSNorms
)
PARAMS = 28 * LAYER + 151936 * 1536 + 1536  # + the embedding (tied: no output layer) + norm
# elements one token leaves per layer: 4h + (q + 2kv) + q + 3f
ACT = 4 * 1536 + (1536 + 2 * 256) + 1536 + 3 * 8960
MIB = 2**20


def test_hand_figures_of_the_model():
    assert LAYER == Q15.layer_params() == 46_797_824
    assert PARAMS == Q15.total_params() == 1_543_714_304
    assert ACT == Q15.layer_activation_elements() == 36_608


def test_optimizer_states_by_their_bytes_per_parameter():
    """megatron-core's Adam states per parameter, sharded over DP: an fp32 main copy and two
    fp32 moments (12); the precision-aware optimiser's int16 master remainder beside fp32
    moments (10); with bf16 moments (6). Only the optimiser term moves."""
    lo = ParallelLayout(1, 1, 1, 8)
    by_states = {
        states: estimate(Q15, lo, MemorySettings(1024, optimizer_states=states), gpu_mem_gib=80)
        for states in ("fp32", "precision-aware", "bf16")
    }
    assert by_states["fp32"].optimizer == PARAMS * 12 / 8
    assert by_states["precision-aware"].optimizer == PARAMS * (2 + 4 + 4) / 8
    assert by_states["bf16"].optimizer == PARAMS * (2 + 2 + 2) / 8
    fp32, bf16 = by_states["fp32"], by_states["bf16"]
    assert fp32.train_phase - bf16.train_phase == PARAMS * 6 / 8
    assert (bf16.weights, bf16.grads) == (fp32.weights, fp32.grads)
    with pytest.raises(ValueError, match="--optimizer-states: one of fp32, precision-aware, bf16"):
        MemorySettings(1024, optimizer_states="fp16")


def test_gradients_fp32_or_bf16_and_bf16_halves_them_exactly():
    lo = ParallelLayout(1, 1, 1, 8)
    fp32 = estimate(Q15, lo, MemorySettings(1024), gpu_mem_gib=80)
    bf16 = estimate(Q15, lo, MemorySettings(1024, grad_reduce="bf16"), gpu_mem_gib=80)
    assert fp32.grads == PARAMS * 4  # megatron-core's main_grad with grad_reduce_in_fp32
    assert bf16.grads == PARAMS * 2  # in the parameters' dtype
    assert bf16.grads == fp32.grads / 2  # the control: only the gradients move
    assert fp32.train_phase - bf16.train_phase == PARAMS * 2
    assert (bf16.weights, bf16.optimizer) == (fp32.weights, fp32.optimizer)


def test_in_flight_micro_batches_as_1f1b_holds_them():
    # PP 4 (7 layers a stage), micro-batches of 2 sequences of 1024 tokens
    lo = ParallelLayout(1, 4, 1, 1)
    unknown = MemorySettings(2048)
    # the step's size unknown: stage s holds pp - s full micro-batches
    assert [in_flight_tokens(unknown, lo, s) for s in range(4)] == [
        (4, 8192), (3, 6144), (2, 4096), (1, 2048),
    ]  # fmt: skip
    e = estimate(Q15, lo, unknown, gpu_mem_gib=80)
    assert e.worst_stage == 0 and e.in_flight == 4
    assert e.activations_no_recompute == 7 * ACT * 2 * 8192
    # a step of 3 sequences on this rank: micro-batches of 2 and 1 sequences; stage 0 holds both,
    # 3072 tokens, not 4 x 2048 (each micro-batch with its own tokens)
    known = replace(unknown, step_tokens=3 * 1024)
    assert [in_flight_tokens(known, lo, s) for s in range(4)] == [
        (2, 3072), (2, 3072), (2, 3072), (1, 2048),
    ]  # fmt: skip
    e = estimate(Q15, lo, known, gpu_mem_gib=80)  # the last stage's logits now weigh most
    assert e.worst_stage == 3 and (e.in_flight, e.in_flight_tokens) == (1, 2048)
    assert e.activations_no_recompute == 7 * ACT * 2 * 2048
    # the step's tokens are shared over data parallelism: 4 ranks of 3072 -> 2 micro-batches
    wide = ParallelLayout(1, 4, 1, 4)
    assert in_flight_tokens(replace(known, step_tokens=4 * 3072), wide, 0) == (2, 3072)
    # full recomputation keeps each held token's layer input (h) and redoes one layer of the
    # current micro-batch; with activations that small the last stage (its logits) is the worst
    full = estimate(Q15, lo, replace(unknown, recompute="full"), gpu_mem_gib=80)
    assert full.worst_stage == 3 and full.in_flight == 1
    assert full.activations_full_recompute == 7 * 1536 * 2 * 2048 + ACT * 2 * 2048


def test_the_refit_terms_by_hand():
    share = EngineShare(0.5, tp=1)
    gpu = 80 * GIB
    one = ParallelLayout(1, 1, 1, 8)
    t = generation_terms(Q15, one, 0, share, gpu)
    assert t.pool == 40 * GIB
    assert t.engine_weights == PARAMS * 2  # the whole model on a TP-1 engine, bf16
    assert t.kv_cache == 40 * GIB - PARAMS * 2
    assert t.refit_bucket == 256 * MIB  # rollout.refit_bucket_mb's default
    assert t.refit_full_param == 151936 * 1536 * 2  # the embedding, gathered whole
    # PP 2: the last stage sends no output layer (tied), its largest tensor is linear_fc1, and
    # the bucket lives on the engine rank (stage 0) alone
    two = ParallelLayout(1, 2, 1, 4)
    last = generation_terms(Q15, two, 1, share, gpu)
    assert largest_full_tensor(Q15, two, 1) == 2 * 8960 * 1536
    assert (last.refit_bucket, last.refit_full_param) == (0.0, 2 * 8960 * 1536 * 2)
    assert generation_terms(Q15, one, 0, replace(share, refit_bucket_mb=0), gpu).refit_bucket == 0


def test_the_generation_phase_and_each_engine_term_moves_it_exactly():
    lo, step = ParallelLayout(1, 1, 1, 8), MemorySettings(1024)
    share = EngineShare(0.5, tp=1)
    base = estimate(Q15, lo, step, gpu_mem_gib=80, vllm=share)
    refit = 256 * MIB + 151936 * 1536 * 2
    # this project's refit: the whole engine awake, the trainer's weights kept (asleep: auto)
    assert base.generate_phase == base.refit_phase == PARAMS * 2 + 40 * GIB + refit
    assert base.peak_phase == "generate"
    # the control: no bucket lowers the phase by exactly the bucket
    nob = estimate(Q15, lo, step, gpu_mem_gib=80, vllm=replace(share, refit_bucket_mb=0))
    assert base.generate_phase - nob.generate_phase == 256 * MIB
    # a refit before the KV cache (verl, NeMo-RL): the engine's weights, not its pool, beside it
    before = estimate(Q15, lo, step, gpu_mem_gib=80, vllm=replace(share, refit_before_kv=True))
    assert before.refit_phase == PARAMS * 2 + PARAMS * 2 + refit
    assert before.generate_phase == PARAMS * 2 + 40 * GIB  # generation itself is the larger
    # the engine's process: in the overheads of both phases, gone with an in-process engine
    torch_part = base.generate_phase - 40 * GIB  # the pool is the engine's own
    outside = (NON_TORCH_GIB + ENGINE_PROCESS_GIB) * GIB + FRAGMENTATION * torch_part
    assert base.engine_process == ENGINE_PROCESS_GIB * GIB == (3.17 + 3.24) / 2 * GIB
    assert base.overhead == pytest.approx(outside)
    inproc = estimate(Q15, lo, step, gpu_mem_gib=80, vllm=replace(share, in_process=True))
    assert base.total - inproc.total == pytest.approx(ENGINE_PROCESS_GIB * GIB)
    assert estimate(Q15, lo, step, gpu_mem_gib=80).engine_process == 0  # no engine, no process


def test_sglang_by_its_key_and_named_in_the_verdict():
    lo, step = ParallelLayout(1, 1, 1, 8), MemorySettings(65536)
    sglang = EngineShare(0.05, tp=1, engine="sglang")
    e = estimate(Q15, lo, step, gpu_mem_gib=80, vllm=sglang)
    # mem_fraction_static covers the weights and the KV cache pool
    assert e.engine_pool == 0.05 * 80 * GIB
    assert e.vllm_kv_cache == 0.05 * 80 * GIB - PARAMS * 2
    # one 65,536-token sequence needs 2 x 28 layers x 2 heads x 128 x 2 bytes a token: 1.75 GiB
    v = assess(Q15, lo, step, gpu_mem_gib=80, vllm=sglang, seq_len=65536)
    assert not v.fits and "SGLang's 0.05 of the GPU" in v.reason and "(1.75 GiB)" in v.reason


def _layout_json(capsys, *flags) -> dict:
    cmd = ["layout", "--model", "qwen2.5-1.5b", "--nodes", "1", "--gpus-per-node", "8",
           "--gpu-mem", "80", "--seq-len", "1024", "--tp", "1", "--pp", "4",
           "--micro-batch-size", "2", "--json", *flags]  # fmt: skip
    assert cli_main(cmd) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_every_term_in_the_json_and_the_text(capsys):
    j = _layout_json(capsys, "--grad-reduce", "bf16", "--group-size", "3", "--prompts-per-step",
                     "2", "--refit-bucket-mb", "128")  # fmt: skip
    assert j["grad_reduce"] == "bf16" and j["engine"] == "vllm" and j["refit_bucket_mb"] == 128
    assert j["engine_mem_fraction"] == 0.6 and j["engine_in_process"] is False
    # 6 sequences over dp 2: 3 a rank, micro-batches of 2 and 1 sequences; the worst stage, 0
    # (the refit's bucket and the embedding are its own), holds both: 3072 tokens, not 4 x 2048
    assert (j["worst_stage"], j["dp"]) == (0, 2)
    assert (j["in_flight_micro_batches"], j["in_flight_tokens"]) == (2, 3072)
    b = j["breakdown_gib"]
    for key in ("engine_pool", "engine_weights", "refit_bucket", "refit_full_param",
                "refit_phase", "engine_process"):  # fmt: skip
        assert key in b, key
    assert b["engine_process"] == round(ENGINE_PROCESS_GIB, 3)
    assert "rollout.refit_bucket_mb=128" in j["overrides"]
    cmd = ["layout", "--model", "qwen2.5-1.5b", "--nodes", "1", "--gpus-per-node", "8",
           "--gpu-mem", "80", "--seq-len", "1024", "--grad-reduce", "bf16"]  # fmt: skip
    assert cli_main(cmd) == 0
    text = capsys.readouterr().out
    for words in ("gradients (bf16)", "in flight", "vllm (0.6 of the GPU)", "refit: bucket",
                  "one full tensor", "engine process"):  # fmt: skip
        assert words in text, words
    s = _layout_json(capsys, "--engine", "sglang", "--sglang-mem-fraction", "0.7")
    assert (s["engine"], s["engine_mem_fraction"]) == ("sglang", 0.7)
    # no recipe key for an engine this project's recipes cannot run
    assert not any(o.startswith("rollout.gpu_memory_utilization") for o in s["overrides"])
    assert _layout_json(capsys, "--vllm-gpu-util", "0")["engine"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grad-reduce", "fp16"], "--grad-reduce"),
        (["--engine", "trtllm"], "--engine"),
        (["--engine", "sglang"], "--sglang-mem-fraction: required with --engine sglang"),
        (["--sglang-mem-fraction", "0.7"], "--sglang-mem-fraction: SGLang's key"),
        (
            ["--engine", "sglang", "--sglang-mem-fraction", "0.7", "--vllm-gpu-util", "0.5"],
            "--vllm-gpu-util: vLLM's key",
        ),
        (["--engine", "sglang", "--sglang-mem-fraction", "1.5"], "--sglang-mem-fraction: must be"),
        (["--vllm-gpu-util", "1"], "--vllm-gpu-util: must be in [0, 1)"),
        (["--refit-bucket-mb", "-1"], "--refit-bucket-mb: must be >= 0"),
        (["--group-size", "0", "--prompts-per-step", "2"], "--group-size: must be >= 1"),
    ],
)
def test_each_flag_refused_by_name(flags, message, capsys):
    cmd = ["layout", "--model", "qwen2.5-1.5b", "--nodes", "1", "--gpus-per-node", "8",
           "--gpu-mem", "80", "--seq-len", "1024", *flags]  # fmt: skip
    try:
        status = cli_main(cmd)
    except SystemExit as e:  # argparse's choices
        status = e.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_the_settings_refuse_by_flag_name():
    with pytest.raises(ValueError, match=r"^--grad-reduce: one of fp32, bf16"):
        MemorySettings(1024, grad_reduce="fp16")
    with pytest.raises(ValueError, match=r"^--group-size x --prompts-per-step"):
        MemorySettings(1024, step_tokens=0)
    with pytest.raises(ValueError, match=r"^--engine: one of vllm, sglang"):
        EngineShare(0.5, engine="trtllm")
    with pytest.raises(ValueError, match=r"^--sglang-mem-fraction: must be in \(0, 1\)"):
        EngineShare(1.2, engine="sglang")
    with pytest.raises(ValueError, match=r"^--refit-bucket-mb: must be >= 0"):
        EngineShare(0.5, refit_bucket_mb=-1)
