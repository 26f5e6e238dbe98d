"""In-memory weight refit: a replica's megatron shards, HF-named, bucket by bucket, to its engine.

    refit = WeightRefit(chunks, spec, groups, bucket_bytes=256 << 20, dtype=torch.float32,
                        hf_config=ENGINE_CONFIG)  # the engine's config.json: its layout's names
    refit.stream(sink)       # collective over the replica's model-parallel group (cp rank 0);
                             # sink(bucket) runs on the engine rank, once per bucket

Each data-parallel replica refits its own engine, so nothing crosses replicas. Within a replica:
every tensor-parallel shard is gathered to TP rank 0 of its stage (`gather_tensor_parallel_to`,
not an all-gather), each stage's TP rank 0 sends its full tensors to the engine rank (stage 0,
point to point), and the engine rank converts each megatron tensor to Hugging Face names
(fused QKV split, gate/up split) and fills the bucket. At no time does a rank hold more than its
shards, one full parameter and one bucket. Context-parallel peers hold identical weights: only
cp rank 0 takes part. Under expert parallelism (EP; TP 1, one pipeline stage) a replica holds
only its EP rank's experts: every rank of each EP group (CP peers included) gathers every expert
tensor, one at a time, and the engine ranks stream them under their global expert numbers
(conversion/experts.py), so each engine gets every expert. Tensors are cast to the engine's
dtype before they travel (exact: a cast commutes with concatenation) and stay on the
parameters' device. The HF names are those of the engine's checkpoint layout (`hf_config`, the
config.json of the folder it loaded): Qwen3.5's published `ForConditionalGeneration` layout
names its language model `model.language_model.*`, which vLLM maps to its own modules, where
the text layout's `model.layers.*` would not be found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_ba.conversion import table_for
from megatron_ba.conversion.experts import expert_layout, global_name
from megatron_ba.conversion.family_table import OUTPUT_LAYER, canonical_name, hf_tensors, is_skipped
from megatron_ba.generation.weight_buckets import iter_buckets
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import local_to_full_names, tp_sharding


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's place in its replica: the process groups and ranks the refit needs."""

    tp_group: object
    pp_group: object
    tp_rank: int
    pp_rank: int
    cp_rank: int

    @property
    def is_engine_rank(self) -> bool:
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    @classmethod
    def of_this_rank(cls) -> ReplicaGroups:
        """This rank's replica groups, from megatron-core's parallel state."""
        from megatron.core import parallel_state as ps  # megatron-core: imported on first use

        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
        )


def _skipped(spec, name: str) -> bool:
    """No HF tensor comes of it (buffers; a tied model's output-layer copy): not sent at all."""

    return is_skipped(name) or (spec.tie_word_embeddings and canonical_name(name) == OUTPUT_LAYER)


class WeightRefit:
    def __init__(
        self,
        chunks,
        spec,
        groups: ReplicaGroups,
        *,
        bucket_bytes: int,
        dtype,
        hf_config: dict | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"rollout.refit_bucket_mb: must be >= 1, got {bucket_bytes} bytes")
        self.spec, self.groups, self.dtype = spec, groups, dtype
        self.table = table_for(spec, hf_config)  # None: the family's text layout
        self.bucket_bytes = bucket_bytes
        held = local_to_full_names(chunks)
        self.ep_rank, ep, self.ep_group = expert_layout(spec)
        self.experts = []  # (global name, local parameter): gathered over EP at each refit
        for name, (param, _) in held.items():
            g = global_name(name, spec, self.ep_rank, ep) if ep > 1 else None
            if g is not None:
                self.experts.append((g, param))
        expert_params = {id(p) for _, p in self.experts}
        self.local = [
            (name, param, tp_sharding(param))
            for name, (param, _) in held.items()
            if not _skipped(spec, name) and id(param) not in expert_params
        ]  # same order on every TP rank of a stage (module order)
        self.stage_meta: list | None = None
        if groups.cp_rank == 0 and groups.tp_rank == 0:
            # Stage 0's TP rank 0 (the engine rank) learns what every stage will send, once.
            mine = [(n, self._full_shape(p, lay)) for n, p, lay in self.local]
            self.stage_meta = collectives.all_gather_object(mine, group=groups.pp_group)
        self.last_bytes = 0

    @staticmethod
    def _full_shape(param, layout) -> list[int]:
        from megatron.core import parallel_state

        shape = list(param.shape)
        sharded, dim, _ = layout
        if sharded:
            shape[dim] *= parallel_state.get_tensor_model_parallel_world_size()
        return shape

    def _full(self, param, layout) -> torch.Tensor | None:
        """This stage's full tensor on its TP rank 0 (None on the other TP ranks)."""
        t = param.detach().to(self.dtype)
        sharded, dim, stride = layout
        if not sharded:
            return t if self.groups.tp_rank == 0 else None
        return collectives.gather_tensor_parallel_to(
            t, dim=dim, stride=stride, group=self.groups.tp_group, dst=0
        )

    def _engine_stream(self):
        """(HF name, tensor) on the engine rank: stage 0's tensors, then each later stage's."""
        table = self.table
        device = self.local[0][1].device if self.local else None
        for name, param, layout in self.local:
            yield from hf_tensors(table, self.spec, name, self._full(param, layout))
        for name, t in self._gathered_experts():
            yield from hf_tensors(table, self.spec, name, t)
        for stage in range(1, len(self.stage_meta)):
            for name, shape in self.stage_meta[stage]:
                t = collectives.send_within_group(
                    None,
                    src=stage,
                    dst=0,
                    shape=shape,
                    dtype=self.dtype,
                    device=device,
                    group=self.groups.pp_group,
                )
                yield from hf_tensors(table, self.spec, name, t)

    def _gathered_experts(self):
        """(global name, full tensor) of every EP rank's experts, one gather at a time (a
        collective over the EP group: each of its ranks walks the same names in order)."""
        for name, param in self.experts:
            every = collectives.gather_pipeline_stages(
                {name: param.detach().to(self.dtype)}, group=self.ep_group
            )
            yield from sorted(every.items())

    def stream(self, sink: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Refit: every rank of the replica calls it; `sink(bucket)` on the engine rank. Returns
        the bytes streamed to the engine (0 elsewhere)."""
        g = self.groups
        if not g.is_engine_rank:  # its EP peers' engines need this rank's experts
            for _ in self._gathered_experts():
                pass
        if g.cp_rank != 0:
            return 0
        if g.is_engine_rank:
            total = 0
            for bucket in iter_buckets(self._engine_stream(), limit_bytes=self.bucket_bytes):
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                sink(bucket)
            self.last_bytes = total
            return total
        for _, param, layout in self.local:
            full = self._full(param, layout)
            if full is not None:  # TP rank 0 of a later stage: on to the engine rank
                collectives.send_within_group(
                    full,
                    src=g.pp_rank,
                    dst=0,
                    shape=None,
                    dtype=None,
                    device=None,
                    group=g.pp_group,
                )
        return 0
