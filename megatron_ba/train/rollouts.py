"""Rollouts of a local GRPO run: the generation engine on rank 0 and the policy's weights in it.

    rollouts = Rollouts.start(recipe, ctx, hf_dir, run_dir, tokenizer, policy)
    ids, samples = rollouts.generate(prompts, n=8, temperature=1.0, seed=s)   # rank 0
    seconds = rollouts.sync(policy)           # collective: gather the policy, load it (rank 0)
    rollouts.close()

The engine is vLLM (megatron_ba.generation.vllm_engine, in its own process by default) or, when
the recipe asks for it, the built-in sampler that samples through the policy itself. Only rank 0
holds an engine; `sync` is still called on every rank because gathering the weights is a
collective.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_ba.recipe import Recipe


class Rollouts:
    def __init__(self, engine, tokenizer, max_new_tokens: int) -> None:
        self.engine, self.tokenizer, self.max_new_tokens = engine, tokenizer, max_new_tokens

    @classmethod
    def start(cls, recipe: Recipe, ctx, hf_dir: Path, run_dir: Path, tokenizer, policy):
        engine = None
        if recipe.rollout.engine == "builtin" and ctx.world != 1:
            raise ValueError("rollout.engine: 'builtin' runs in single-process runs only")
        if recipe.rollout.in_process and ctx.world > 1:
            raise ValueError(
                "rollout.in_process: vLLM can share the trainer's process only when the "
                "world is one process (it would join the trainer's process groups)"
            )
        if ctx.is_main:
            engine = _engine(recipe, hf_dir, run_dir, tokenizer, policy)
        return cls(engine, tokenizer, recipe.grpo.max_new_tokens)

    def generate(
        self,
        prompts: list[str],
        n: int,
        temperature: float,
        seed: int,
        max_tokens: int | None = None,
    ):
        """Token ids of the prompts and n samples for each (rank 0); max_tokens defaults to the
        recipe's `grpo.max_new_tokens`."""
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        samples = self.engine.generate(
            ids,
            n=n,
            temperature=temperature,
            max_tokens=self.max_new_tokens if max_tokens is None else max_tokens,
            seed=seed,
        )
        return ids, samples

    def generate_fn(self, seed: int):
        """The evaluation runner's `generate(prompts, n, temperature, max_tokens)` callable:
        the same tokenisation and per-prompt seeds as the rollouts."""

        def generate(prompts: list[str], n: int, temperature: float, max_tokens: int):
            _, out = self.generate(prompts, n, temperature, seed, max_tokens)
            return [[s.text for s in group] for group in out]

        return generate

    def sync(self, policy) -> float:
        """Load the policy's current weights into the engine; seconds taken (every rank calls)."""
        t = time.perf_counter()
        named = policy.hf_weights()  # collective
        if named is not None and hasattr(self.engine, "load_weights"):
            self.engine.load_weights(named)
        return time.perf_counter() - t

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()


def _engine(recipe: Recipe, hf_dir: Path, run_dir: Path, tokenizer, policy):
    r = recipe.rollout
    if r.engine == "vllm":
        from megatron_ba.generation.vllm_engine import VLLMEngine

        return VLLMEngine(
            str(hf_dir),
            sync_dir=str(run_dir / ".weights"),
            in_process=r.in_process,
            max_model_len=policy.spec.max_position_embeddings,
            seed=recipe.seed,
            kv_cache_gb=r.kv_cache_gb,
            threads=r.threads,
        )
    from megatron_ba.generation.builtin_sampler import BuiltinSampler

    return BuiltinSampler(
        policy.full_vocab_forward,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
