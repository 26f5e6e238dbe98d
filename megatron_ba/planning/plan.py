"""The planner's answer: a layout, its step settings and their estimate (Plan), as recipe
keys (`overrides`) and as `megatron-ba layout --json` prints it (`to_json`); NoLayoutFits when
nothing fits, carrying what came closest. planning.cluster_layout searches for it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from megatron_ba.errors import UserError
from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import (
    UNEVEN,
    ParallelLayout,
)
from megatron_ba.planning.generation_memory import REFIT_BUCKET_MB, engine_json
from megatron_ba.planning.memory import EngineShare, MemoryEstimate, MemorySettings
from megatron_ba.planning.verdict import HEADROOM, Verdict, assess
from megatron_ba.step_settings import AUTO_CHUNK, AUTO_CHUNK_ABOVE


@dataclass
class Plan:
    shape: ModelShape
    layout: ParallelLayout
    step: MemorySettings
    estimate: MemoryEstimate
    micro_batch_size: int  # sequences per micro-batch per model replica
    seq_len: int
    sequences_per_step: int | None
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    alternatives: list[dict] = field(default_factory=list)
    vllm: EngineShare | None = None  # the colocated engine the estimate assumes (None: none)
    headroom: float = HEADROOM  # what the verdict's tensors' peak leaves free (planning.verdict)

    def overrides(self) -> list[str]:
        """Recipe keys (docs/recipes.md) that select this layout and the settings its estimate
        assumes: uneven pipeline stages' layers, expert parallelism, sequence parallelism, full
        recomputation, chunked log-probs (the key only where `parallel.logprob_chunk_size:
        null`'s auto rule would not chunk: micro-batches of at most recipe.AUTO_CHUNK_ABOVE
        tokens, or a chunk other than its AUTO_CHUNK), and the colocated vLLM engine's share of
        the GPU, sleep mode and tensor parallelism (a vLLM engine's: this project's recipes run
        no SGLang), its refit bucket where it is not the recipe's default."""
        lo, step = self.layout, self.step
        out = [
            f"parallel.tp={lo.tp}",
            f"parallel.pp={lo.pp}",
            f"parallel.cp={lo.cp}",
            f"parallel.micro_batch_size={self.micro_batch_size}",
        ]
        out += [f"parallel.{k}={getattr(lo, k)}" for k in UNEVEN if getattr(lo, k) is not None]
        if lo.ep > 1:
            out.append(f"parallel.ep={lo.ep}")
            if lo.etp is not None and lo.etp != lo.tp:  # megatron-core's default expert TP: tp
                out.append(f"parallel.etp={lo.etp}")
        if lo.sequence_parallel:
            out.append("parallel.sequence_parallel=true")
        if step.recompute_mode != "none":
            out.append(f"parallel.recompute={step.recompute_mode}")
        auto = step.micro_batch_tokens > AUTO_CHUNK_ABOVE and step.logprob_chunk == AUTO_CHUNK
        if step.logprob_mode == "chunked" and not auto:
            out.append(f"parallel.logprob_chunk_size={step.logprob_chunk}")
        if self.vllm is not None and self.vllm.engine == "vllm":
            out.append(f"rollout.gpu_memory_utilization={self.vllm.gpu_util}")
            out.append(f"rollout.sleep={str(self.vllm.sleeps).lower()}")
            # the engine's weights are split as the estimate assumed (one GPU's engine must hold
            # a whole copy otherwise: 61 GiB for a 32B model, more than its share)
            engine_tp = self.vllm.tp or lo.tp
            if engine_tp > 1:
                out.append(f"rollout.engine_tp={engine_tp}")
            if self.vllm.refit_bucket_mb != REFIT_BUCKET_MB:
                out.append(f"rollout.refit_bucket_mb={self.vllm.refit_bucket_mb:g}")
        return out

    def to_json(self) -> dict:
        lo, step = self.layout, self.step
        return {
            "model": self.shape.name,
            "params_billion": round(self.shape.total_params() / 1e9, 3),
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "gpu_mem_gib": self.gpu_mem_gib,
            "tp": lo.tp,
            "pp": lo.pp,
            "cp": lo.cp,
            "dp": lo.dp,
            "pp_first_stage_layers": lo.pp_first_stage_layers,
            "pp_last_stage_layers": lo.pp_last_stage_layers,
            "stage_layers": list(lo.stage_layers(self.shape.num_layers)),
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_tokens": step.micro_batch_tokens,
            "micro_batch_tokens_per_gpu": step.micro_batch_tokens // lo.cp,
            "ep": lo.ep,
            "etp": lo.etp,
            "sequence_parallel": lo.sequence_parallel,
            "recompute": step.recompute,
            "recompute_mode": step.recompute_mode,
            "offload": step.offload,
            "cpu_adam": step.cpu_adam,
            "distributed_optimizer": step.distributed_optimizer,
            "chunked_logprobs": step.chunked_logprobs,
            "logprobs": step.logprob_mode,
            "grad_reduce": step.grad_reduce,
            "optimizer_states": step.optimizer_states,
            "logprob_tokens": step.logprob_tokens,
            "virtual_pipeline_size": step.virtual_pipeline,
            "in_flight_micro_batches": self.estimate.in_flight,
            "in_flight_tokens": self.estimate.in_flight_tokens,
            **engine_json(self.vllm),
            "fits": self.fits,
            "headroom": self.headroom,
            "why_not": self.verdict.reason,
            "memory_gib_per_gpu": round(self.estimate.total_gib, 2),
            "peak_phase": self.estimate.peak_phase,
            "worst_stage": self.estimate.worst_stage,
            "breakdown_gib": self.estimate.breakdown_gib(),
            # sequences of seq_len tokens the colocated engine's KV cache holds at once (its
            # per-sequence terms: breakdown_gib's engine_*_per_sequence)
            "engine_sequences": self.estimate.engine_sequences,
            "sequences_per_step": self.sequences_per_step,
            "overrides": self.overrides(),
            "alternatives": self.alternatives,
        }

    @property
    def verdict(self) -> Verdict:
        """planning.verdict.assess on this layout at the plan's headroom: the rule the search
        applied, so `fits` is what the exit status of `megatron-ba layout` says."""
        return assess(
            self.shape, self.layout, self.step, gpu_mem_gib=self.gpu_mem_gib, vllm=self.vllm,
            seq_len=self.seq_len, headroom=self.headroom,
        )  # fmt: skip

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


class NoLayoutFits(UserError):
    """No layout holds one sequence per micro-batch; the message says what came closest, and
    `closest` is that layout's Plan (its `fits` false, `verdict.reason` why), or what refused
    every candidate layout when none could be built (`closest` None)."""

    def __init__(self, message: str, closest: Plan | None = None):
        super().__init__(message)
        self.closest = closest
