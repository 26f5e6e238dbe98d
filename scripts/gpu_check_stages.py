"""The stages of scripts/gpu_check.py after `env`: each runs one command under its budget and
reads its figures (the driver's Check records them). GPU sizes, and the CPU dry run's tiny ones.

  attention      `perf attention`: the SDPA core vs megatron-core's unfused core on the GPU's
                 kernels, bf16 and fp32, error against float64 (criterion: no worse than twice
                 the unfused core's), and each core's memory and time at 8,192 tokens
  train_0p5b     `perf train-lm`: a random Qwen2.5-0.5B-shaped model, SDPA core, 20 bf16 steps
                 through megatron-core's distributed optimiser on a fixed synthetic batch (8 x
                 4,096 tokens), then 6 fp32 steps from the same weights: loss fall, bf16 vs fp32
                 within 5 %, tokens/s, MFU (planning/flops.py) over the H200's 989 TFLOP/s
  memory_1p5b    `perf step`: one GRPO step of a Qwen2.5-1.5B shape at 16,384 tokens (1,024
                 prompt), bf16, SDPA core, full recomputation, chunked log-probs: the measured
                 peak against planning.memory's estimate of that shape and layout
  step           `perf step` BA vs token-mean, bf16 (goal: <= 1.02x)
  aggregation    `perf aggregation`: the packed GRPO loss, balanced / token-mean, forward and
                 backward over 16.7M fp32 log-probs of 2,048 sequences (goal: <= 1.05x)
  train          `megatron-ba train recipes/tiny-cpu.yaml` in bf16, 2 GRPO steps
  vocab_parallel `perf vocab-parallel` at T=16,384: time, peak vs the naive path
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.planning.memory import GIB, MemorySettings, estimate

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_ba.cli"]
PROMPT, TOKENS = 1024, 16384  # the memory stage's sequence: prompt + response = 16K tokens
LOGPROB_CHUNK = 1024


def _args(text: str) -> list[str]:
    return text.split()


def stage_attention(c, device: str) -> None:
    path = c.work / "attention.json"
    size = (
        _args("--dtypes fp32 --seq-len 64 --memory-seq-len 256")
        if c.cpu
        else _args("--dtypes bf16,fp32 --seq-len 2048 --batch 2 --memory-seq-len 8192")
    )
    cmd = [*CLI, "perf", "attention", "--device", device, *size, "--json", str(path)]

    def figures(_text: str) -> dict:
        d = json.loads(path.read_text())
        d.pop("args", None)
        return d

    c.run("attention", cmd, figures=figures)


def stage_train_lm(c) -> None:
    path = c.work / "train_lm.json"
    if c.cpu:  # plumbing: fp32 twice (bf16 needs CUDA), a tiny shape
        size = _args(
            "--shape tiny --device cpu --dtype fp32 --compare-dtype fp32 --steps 6 "
            "--compare-steps 3 --sequences 4 --seq-len 64 --micro-batches 2 --data-vocab 256 "
            "--block 16 --lr 1e-3 --threads 2"
        )
    else:
        size = _args(
            "--shape qwen2.5-0.5b --device cuda --dtype bf16 --compare-dtype fp32 --steps 20 "
            "--compare-steps 6 --sequences 8 --seq-len 4096 --micro-batches 4 --data-vocab 4096 "
            "--block 64 --lr 3e-4 --warmup-steps 3 --rel-tol 0.05 --min-drop 1.0"
        )
    cmd = [*CLI, "perf", "train-lm", *size, "--attention", "sdpa", "--json", str(path)]

    def figures(_text: str) -> dict:
        d = json.loads(path.read_text())
        runs = d["runs"]
        return {
            "parameters": d["parameters"],
            "tokens_per_step": d["tokens_per_step"],
            "losses": {r["precision"] + "_" + k: r["losses"] for k, r in runs.items()},
            "peak_allocated_gib": {k: r.get("peak_allocated_gib") for k, r in runs.items()},
            "attention": runs["timed"]["attention"],
            "optimizer": runs["timed"]["optimizer"],
            "loss_fell": d["loss_fell"],
            "precision_comparison": d.get("precision_comparison"),
            "throughput": d["throughput"],
            "ok": d["ok"],
        }

    c.run("train_0p5b", cmd, figures=figures)


def planner_estimate(shape: ModelShape, tokens: int, recompute: bool, chunk: int) -> dict:
    """planning.memory's estimate of one GRPO step of this shape on one GPU (TP = PP = CP = DP =
    1, one `tokens`-token sequence per micro-batch, chunked log-probs, no vLLM)."""
    step = MemorySettings(
        micro_batch_tokens=tokens, recompute=recompute, chunked_logprobs=True, logprob_chunk=chunk
    )
    est = estimate(shape, ParallelLayout(), step, gpu_mem_gib=1e6, vllm=None)
    return {
        "estimate_gib": est.peak / GIB,
        "estimate_bytes": est.peak,
        "breakdown_gib": est.breakdown_gib(),
        "parameters": shape.total_params(),
        "layout": "tp=1 pp=1 cp=1 dp=1, one sequence per micro-batch, "
        f"recompute={recompute}, chunked log-probs (chunk {chunk}), no vLLM",
    }


def memory_comparison(step: dict, estimate: dict) -> dict:
    """The measured peaks (the larger of the BA and token-mean steps) over the estimate."""
    allocated = max(step["ba_peak_mib"], step["token_mean_peak_mib"]) / 1024
    reserved = max(step["ba_peak_reserved_mib"], step["token_mean_peak_reserved_mib"]) / 1024
    return {
        "measured_peak_gib": allocated,
        "measured_peak_reserved_gib": reserved,
        "estimate_gib": estimate["estimate_gib"],
        "measured_over_estimate": allocated / estimate["estimate_gib"],
        "reserved_over_estimate": reserved / estimate["estimate_gib"],
    }


def _memory_setup(cpu: bool) -> tuple[list[str], ModelShape, int, bool, int]:
    """(perf step arguments, the model's shape, tokens, recompute, chunk)."""
    shape = PRESETS["qwen2.5-1.5b"]
    if cpu:  # plumbing: a 2-layer slice of small width, no recompute (perf step: CUDA only)
        shape = dataclasses.replace(
            shape,
            hidden_size=128,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=384,
            vocab_size=1024,
        )
        tokens, recompute, chunk = 128, False, 64
        args = _args(
            "--device cpu --hidden 128 --layers 2 --heads 4 --query-groups 2 --ffn 384 "
            f"--vocab 1024 --seq-len {tokens} --prompt-len 8 --threads 2"
        )
    else:
        tokens, recompute, chunk = TOKENS, True, LOGPROB_CHUNK
        args = _args(
            f"--device cuda --seq-len {tokens} --prompt-len {PROMPT} --dtype bf16 --recompute full"
        )
    common = _args(
        "--shape qwen2.5-1.5b --sequences 2 --group-size 2 --micro-batches 2 --repeats 1 "
        f"--warmup 0 --attention sdpa --logprob-chunk-size {chunk}"
    )
    return [*common, *args], shape, tokens, recompute, chunk


def stage_memory_1p5b(c) -> None:
    path = c.work / "memory_1p5b.json"
    args, shape, tokens, recompute, chunk = _memory_setup(c.cpu)
    estimate = planner_estimate(shape, tokens, recompute, chunk)
    c.record("memory_1p5b", planner=estimate)

    def figures(_text: str) -> dict:
        step = json.loads(path.read_text())
        return {
            "tokens_per_sequence": tokens,
            "memory_kind": step["memory_kind"],
            "attention": step["attention"],
            "recompute": step["recompute"],
            "parameters": step["parameters"],
            **memory_comparison(step, estimate),
            "step": {k: v for k, v in step.items() if k != "args"},
        }

    cmd = [*CLI, "perf", "step", *args, "--json", str(path)]
    c.run("memory_1p5b", cmd, figures=figures)


def stage_step(c, device: str) -> None:
    path = c.work / "step.json"
    if c.cpu:
        size = _args(
            "--shape tiny --sequences 8 --group-size 4 --seq-len 64 --prompt-len 16 --repeats 2 "
            "--warmup 1 --threads 2"
        )
    else:
        size = _args(
            "--shape small --sequences 32 --group-size 8 --seq-len 2048 --prompt-len 256 "
            "--micro-batches 4 --repeats 5 --warmup 2 --dtype bf16 --logprob-chunk-size 1024"
        )
    cmd = [*CLI, "perf", "step", "--device", device, *size, "--json", str(path)]

    def figures(_text: str) -> dict:
        d = json.loads(path.read_text())
        d.pop("args", None)
        return d

    c.run("step", cmd, figures=figures)


def stage_aggregation(c, device: str) -> None:
    size = (
        _args("--sequences 64 --max-length 256 --repeats 2 --threads 2")
        if c.cpu
        else _args("--sequences 2048 --max-length 16384 --repeats 9")
    )
    cmd = [*CLI, "perf", "aggregation", "--device", device, *size, "--json"]

    def figures(text: str) -> dict:
        lines = [x for x in text.splitlines() if x.startswith("{")]
        if not lines:
            raise ValueError("perf aggregation printed no JSON line")
        return json.loads(lines[-1])

    c.run("aggregation", cmd, figures=figures)


def stage_train(c, vllm: bool) -> None:
    run_dir = c.work / "train"
    keys = [
        f"model.precision={'fp32' if c.cpu else 'bf16'}",
        "model.transformer_impl=auto",
        "model.attention=auto",
        f"rollout.engine={'vllm' if vllm else 'builtin'}",
        "warmstart.steps=20",
        "grpo.steps=2",
        "grpo.prompts_per_step=4",
        "grpo.group_size=4",
        "grpo.max_new_tokens=16",
        "parallel.micro_batch_size=4",
        "eval.every=0",
        "checkpoint.every=0",
        "logging.plots=false",
    ]

    def figures(_text: str) -> dict:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        if not rows:
            raise ValueError("metrics.jsonl is empty")
        last = rows[-1]
        return {
            "steps": len(rows),
            "last_step": {k: v for k, v in last.items() if isinstance(v, int | float)},
            "run_dir": str(run_dir),
        }

    cmd = [
        *CLI,
        "train",
        "recipes/tiny-cpu.yaml",
        *keys,
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(c.work / "cache"),
    ]
    c.run("train", cmd, figures=figures)


def stage_vocab_parallel(c, device: str) -> None:
    path = c.work / "vocab_parallel.json"
    size = (
        _args("--tokens 256 --vocab 4096 --tp 1 --rounds 1 --chunk-sizes 64")
        if c.cpu
        else _args("--tokens 16384 --rounds 3 --chunk-sizes 256,1024")
    )
    cmd = [*CLI, "perf", "vocab-parallel", "--device", device, *size, "--json", str(path)]
    keep = (
        "peak_extra_mib",
        "memory_ratio",
        "median_s",
        "min_s",
        "time_ratio",
        "max_abs_diff_vs_naive",
    )

    def figures(_text: str) -> dict:
        d = json.loads(path.read_text())
        rows = {r["variant"]: r for r in d["rows"]}
        return {
            "tokens": d["args"]["tokens"],
            "memory_kind": d["memory_kind"],
            "variants": {v: {k: r[k] for k in keep} for v, r in rows.items()},
        }

    c.run("vocab_parallel", cmd, figures=figures)
