"""The policy of a local GRPO run on this rank: megatron-core chunks, the frozen reference, AdamW.

    policy = Policy.from_hf(hf_dir, recipe, is_main=ctx.is_main, layout=ctx.layout,
                            device=ctx.device)     # any TP / PP / EP layout
    policy.set_lr(step)                        # linear warm-up of recipe.optimizer.lr
    policy.export_hf(out_dir, tokenizer)       # collective: rank 0 writes a Hugging Face folder

The architecture comes from the Hugging Face folder's config.json (Qwen2 / Qwen2.5 / Qwen3,
megatron_ba.conversion) and the weights stream into this rank's shards one tensor at a time.
Training runs in `model.precision` (fp32, or bf16 with fp32 main weights on CUDA:
megatron_ba.megatron.optimizer_choice) whatever the checkpoint's dtype; exports are written in
the source checkpoint's dtype, so that a run with learning rate 0 exports its input bit for bit.
Every conversion between megatron-core's names and Hugging Face names goes through this class.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ba.conversion import (
    export_chunks_to_hf,
    load_hf_into_chunks,
    spec_from_hf_dir,
)
from megatron_ba.conversion.hf_config import dtype as config_dtype
from megatron_ba.errors import UserError
from megatron_ba.megatron.build_options import expert_config_fields, resolve_build_options
from megatron_ba.megatron.model import build_model_chunks, transformer_config
from megatron_ba.megatron.optimizer_choice import apply_lr_schedule, build_optimizer, ddp_overrides
from megatron_ba.megatron.routing_replay import routing_replay_fields
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS, LayoutError, ParallelLayout
from megatron_ba.recipe import Recipe


def check_shape_keys(recipe: Recipe, spec, source: Path) -> None:
    """The recipe's model.* shape keys must agree with the checkpoint's config.json."""
    for key, value in recipe.model.set_shape_keys().items():
        have = getattr(spec, key)
        if have != value:
            raise ValueError(
                f"model.{key}: the recipe says {value} but {source}/config.json says {have}; "
                f"remove model.{key} (the checkpoint decides the architecture)"
            )
    rope = recipe.model.rope_scaling
    if rope.type is not None and rope.settings() != spec.rope_scaling:
        have = "plain RoPE" if spec.rope_scaling is None else spec.rope_scaling.hf_fields()
        want = "plain RoPE" if rope.type == "default" else rope.settings().hf_fields()
        raise ValueError(
            f"model.rope_scaling: the recipe says {want} but {source}/config.json says {have}; "
            "set rope_scaling in config.json as the recipe's header says (the checkpoint decides "
            "the architecture; vLLM reads the same file)"
        )


class Policy:
    def __init__(self, spec, chunks, ref_chunks, optimizer, recipe: Recipe, *, source, is_main):
        self.spec, self.chunks, self.ref_chunks = spec, chunks, ref_chunks
        self.optimizer, self.recipe = optimizer, recipe
        self.source, self.is_main = Path(source), is_main

    @classmethod
    def from_hf(
        cls,
        hf_dir: str | Path,
        recipe: Recipe,
        *,
        is_main: bool,
        layout: ParallelLayout,
        device: torch.device,
    ) -> Policy:
        """The policy (and, with the KL term on, its frozen reference) from an HF folder, built
        for `layout` (the joined world's: `DistContext.layout`) on this rank's `device`
        (`DistContext.device`; megatron-core allocates on the current CUDA device, which
        parallel.world.join_world made this rank's GPU)."""

        hf_dir = Path(hf_dir)
        m, p = recipe.model, recipe.parallel
        opts = resolve_build_options(
            precision=m.precision,
            transformer_impl=m.transformer_impl,
            attention=m.attention,
            recompute=p.recompute,
            device=device,
            layout=layout,
        )
        spec = spec_from_hf_dir(hf_dir, params_dtype=torch.float32, init_std=m.init_std)
        check_shape_keys(recipe, spec, hf_dir)
        try:
            layout.check_training(spec)
        except LayoutError as e:
            raise UserError(f"{e.renamed(RECIPE_KEYS)} ({hf_dir}/config.json)") from None
        if layout.ep > 1 and layout.pp > 1:
            raise ValueError(
                "parallel.ep: expert parallelism with parallel.pp > 1 is not trained here yet "
                "(the rollout engines' refit gathers experts within one pipeline stage)"
            )
        experts = expert_config_fields(spec, layout)
        if recipe.rollout.routing_replay:
            experts |= routing_replay_fields(spec.num_experts, layout, recompute=p.recompute)
        config = transformer_config(
            spec, cpu=device.type == "cpu", **opts.config_fields(), **experts
        )
        build = dict(config=config, layer_spec=opts.layer_spec(spec, config))
        build["pg_collection"] = opts.pg_collection()
        chunks = build_model_chunks(
            spec, ddp_config_overrides=ddp_overrides(m.precision, device), **build
        )
        load_hf_into_chunks(chunks, hf_dir, spec)
        ref_chunks = None
        if recipe.loss.kl_coef > 0:
            # The reference policy of the KL term: the starting weights, frozen, no DDP wrapper.
            ref_chunks = build_model_chunks(spec, ddp=False, **build)
            load_hf_into_chunks(ref_chunks, hf_dir, spec)
            for c in ref_chunks:
                c.requires_grad_(False)
        optimizer = build_optimizer(chunks, recipe.optimizer, precision=m.precision, device=device)
        policy = cls(spec, chunks, ref_chunks, optimizer, recipe, source=hf_dir, is_main=is_main)
        policy.build_options, policy.device = opts, device
        return policy

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    def set_lr(self, step: int) -> None:
        """Linear warm-up over `optimizer.warmup_steps` optimiser steps, then constant (on CUDA
        by megatron-core's OptimizerParamScheduler, the same schedule)."""

        o = self.recipe.optimizer
        apply_lr_schedule(self.optimizer, step, lr=o.lr, warmup_steps=o.warmup_steps)

    def export_hf(self, out_dir: Path, tokenizer) -> None:
        """A Hugging Face folder of the current policy, in the source checkpoint's dtype
        (collective; rank 0 writes). Config, tokenizer and generation config follow the source."""

        source_cfg = json.loads((self.source / "config.json").read_text())
        export_chunks_to_hf(
            self.chunks,
            self.spec,
            out_dir,
            source_dir=self.source,
            tokenizer=tokenizer,
            dtype=config_dtype(source_cfg),
        )

    @torch.no_grad()
    def full_vocab_forward(self, tokens, position_ids, attention_mask):
        """Logits over the whole vocabulary (single-stage, TP=1 runs: the built-in sampler)."""
        model = self.chunks[0]
        model.eval()
        out = model(tokens, position_ids, attention_mask)
        model.train()
        return out
