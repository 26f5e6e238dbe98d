"""The policy of a local GRPO run on this rank: megatron-core chunks, the frozen reference, AdamW.

    policy = Policy.build(spec, start_weights, recipe, with_reference=recipe.loss.kl_coef > 0)
    policy.set_lr(step)                        # linear warm-up of recipe.optimizer.lr
    named = policy.hf_weights()                # collective: HF-named tensors on rank 0, else None
    policy.export_hf(out_dir, tokenizer)       # collective: rank 0 writes a Hugging Face folder

Every conversion between megatron-core's full-shape names and Hugging Face names goes through
this class, so the vLLM weight sync, the exports and the checkpoints agree on one mapping.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_ba.recipe import Recipe


class Policy:
    def __init__(self, spec, chunks, ref_chunks, optimizer, recipe: Recipe, *, is_main: bool):
        self.spec, self.chunks, self.ref_chunks = spec, chunks, ref_chunks
        self.optimizer, self.recipe, self.is_main = optimizer, recipe, is_main

    @classmethod
    def build(cls, spec, hf_state: dict[str, torch.Tensor], recipe: Recipe, *, is_main: bool):
        """The policy (and, when the KL term is on, its frozen reference) from HF weights."""
        from megatron_ba.megatron.model import build_model_chunks, load_full_state_dict
        from megatron_ba.megatron.optimizer import ShardedAdamW
        from megatron_ba.train.hf_convert import hf_to_megatron

        start = hf_to_megatron(
            hf_state,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
        )
        chunks = build_model_chunks(spec)
        load_full_state_dict(chunks, start)
        ref_chunks = None
        if recipe.loss.kl_coef > 0:
            # The reference policy of the KL term: the starting weights, frozen, no DDP wrapper.
            ref_chunks = build_model_chunks(spec, ddp=False)
            load_full_state_dict(ref_chunks, start)
            for c in ref_chunks:
                c.requires_grad_(False)
        o = recipe.optimizer
        optimizer = ShardedAdamW(
            chunks,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            clip_grad=o.grad_clip,
        )
        return cls(spec, chunks, ref_chunks, optimizer, recipe, is_main=is_main)

    @property
    def lr(self) -> float:
        return self.optimizer.optimizer.param_groups[0]["lr"]

    def set_lr(self, step: int) -> None:
        """Linear warm-up over `optimizer.warmup_steps` optimiser steps, then constant."""
        o = self.recipe.optimizer
        scale = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps > 0 else 1.0
        for group in self.optimizer.optimizer.param_groups:
            group["lr"] = o.lr * scale

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Gather the full policy (a collective: every rank calls it); HF-named on rank 0."""
        from megatron_ba.megatron.model import gather_full_state_dict
        from megatron_ba.train.hf_convert import megatron_to_hf

        full = gather_full_state_dict(self.chunks)
        if not self.is_main:
            return None
        return megatron_to_hf(
            full,
            num_attention_heads=self.spec.num_attention_heads,
            num_query_groups=self.spec.num_query_groups,
        )

    def export_hf(self, out_dir: Path, tokenizer) -> None:
        """A Hugging Face folder of the current policy (collective; rank 0 writes)."""
        from megatron_ba.megatron.model import gather_full_state_dict
        from megatron_ba.train.hf_convert import save_hf_model

        full = gather_full_state_dict(self.chunks)
        if self.is_main:
            save_hf_model(out_dir, full, self.spec, tokenizer)

    @torch.no_grad()
    def full_vocab_forward(self, tokens, position_ids, attention_mask):
        """Logits over the whole vocabulary (single-stage, TP=1 runs: the built-in sampler)."""
        model = self.chunks[0]
        model.eval()
        out = model(tokens, position_ids, attention_mask)
        model.train()
        return out
