"""Propose a TP x PP x CP x DP layout and a micro-batch size that fit a cluster, for GRPO.

    plan = propose(load_model("Qwen2.5-32B"), nodes=8, gpus_per_node=8, gpu_mem_gib=80,
                   max_response_len=12288, group_size=16, prompts_per_step=32)
    plan.layout, plan.step, plan.estimate.peak_gib, plan.overrides(), plan.to_json()
    propose(..., only={"tp": 2, "ep": 8})     # pin fields of the layout (ParallelLayout's)

Search: every tp dividing the GPUs of a node (TP stays inside a node, on NVLink), every pp dividing
the layers, cp a power of two, dp what is left of the world, each a ParallelLayout the model can
train on (parallel_layout: tp divides the heads and KV heads, expert parallelism fits; a mixture of
experts at ep=1 unless pinned, its experts whole on each GPU (etp 1) unless pinned, with sequence
parallelism wherever tp > 1); for each, the largest micro-batch (whole sequences of
prompt_len + max_response_len tokens, padded) whose estimate leaves `headroom` of the GPU free,
first without activation recomputation, then with it. Among the layouts that fit one sequence
per micro-batch the proposal is, by `Settings.prefer`:

* "parallelism" (the default): the most data parallelism (the least model parallelism), then
  the smallest pp and cp (TP is the cheapest split inside a node), then no recomputation, then
  the largest micro-batch;
* "compute": the least recomputed compute first (RECOMPUTE_COST: full recomputation redoes
  every layer's forward, 4/3 of a step's model FLOPs; none and selective with flash attention
  redo nothing), then the "parallelism" order. On a given number of GPUs every layout shares
  the step's model FLOPs equally, so recomputation is the compute that differs between them;
  what TP, CP and PP cost in communication and bubbles is not modelled, only ordered as above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from megatron_ba.errors import UserError
from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout
from megatron_ba.planning.memory import (
    GIB,
    MemoryEstimate,
    MemorySettings,
    VLLMShare,
    estimate,
    kv_cache_bytes_per_token,
    padded_seq_len,
)
from megatron_ba.planning.verdict import Verdict, assess
from megatron_ba.step_settings import AUTO_CHUNK, AUTO_CHUNK_ABOVE

# A step's compute relative to its model FLOPs (forward 1/3, backward 2/3 of 6 N S): full
# recomputation runs each layer's forward twice; selective (core attention) with flash attention
# recomputes nothing the estimate counts (it keeps what none keeps).
RECOMPUTE_COST = {"none": 1.0, "selective": 1.0, "full": 4 / 3}
PREFER = ("parallelism", "compute")

DEFAULT_VLLM = VLLMShare()  # colocated (the recipe's default share), asleep while training


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
    vllm: VLLMShare | None = None  # the colocated engine the estimate assumes (None: none)

    def overrides(self) -> list[str]:
        """Recipe keys (docs/recipes.md) that select this layout and the settings its estimate
        assumes: expert parallelism, sequence parallelism, full recomputation, chunked log-probs
        (the key only where `parallel.logprob_chunk_size: null`'s auto rule would not chunk:
        micro-batches of at most recipe.AUTO_CHUNK_ABOVE tokens, or a chunk other than its
        AUTO_CHUNK), and the colocated vLLM engine's share of the GPU, sleep mode and tensor
        parallelism."""
        lo, step = self.layout, self.step
        out = [
            f"parallel.tp={lo.tp}",
            f"parallel.pp={lo.pp}",
            f"parallel.cp={lo.cp}",
            f"parallel.micro_batch_size={self.micro_batch_size}",
        ]
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
        if self.vllm is not None:
            out.append(f"rollout.gpu_memory_utilization={self.vllm.gpu_util}")
            out.append(f"rollout.sleep={str(self.vllm.sleeps).lower()}")
            # the engine's weights are split as the estimate assumed (one GPU's engine must hold
            # a whole copy otherwise: 61 GiB for a 32B model, more than its share)
            engine_tp = self.vllm.tp or lo.tp
            if engine_tp > 1:
                out.append(f"rollout.engine_tp={engine_tp}")
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
            "fits": self.fits,
            "why_not": self.verdict.reason,
            "memory_gib_per_gpu": round(self.estimate.total_gib, 2),
            "peak_phase": self.estimate.peak_phase,
            "worst_stage": self.estimate.worst_stage,
            "breakdown_gib": self.estimate.breakdown_gib(),
            "sequences_per_step": self.sequences_per_step,
            "overrides": self.overrides(),
            "alternatives": self.alternatives,
        }

    @property
    def verdict(self) -> Verdict:
        """planning.verdict.assess on this layout: the estimate, overheads included, within the
        GPU's whole memory, and a colocated vLLM able to hold one sequence's KV cache."""
        return assess(
            self.shape, self.layout, self.step, gpu_mem_gib=self.gpu_mem_gib, vllm=self.vllm,
            seq_len=self.seq_len,
        )  # fmt: skip

    @property
    def fits(self) -> bool:
        return self.verdict.fits

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


class NoLayoutFits(UserError):
    """No layout holds one sequence per micro-batch; the message says what came closest, and
    `closest` is that layout's Plan (its `fits` may still be true: within the GPU, not within
    the headroom)."""

    def __init__(self, message: str, closest: Plan | None = None):
        super().__init__(message)
        self.closest = closest


@dataclass(frozen=True)
class Settings:
    """What the search does not choose besides the layout fields `propose(only=...)` pins:
    recomputation (None: none, then full where needed), micro-batch (sequences, or tokens per
    GPU; None: the largest that fits), offload, hybrid CPU Adam's fraction, the distributed
    optimiser, the log-prob path, a reference policy on the GPU, and how the fitting layouts
    are ranked (`prefer`, module docstring)."""

    recompute: str | None = None
    micro_batch_size: int | None = None
    max_tokens_per_gpu: int | None = None
    offload: str = "auto"
    cpu_adam: float = 0.0
    distributed_optimizer: bool = True
    logprobs: str = "chunked"
    reference: bool = False
    prefer: str = "parallelism"


def rank_key(
    layout: ParallelLayout, step: MemorySettings, micro_batch_size: int, prefer: str = "parallelism"
) -> tuple:
    """The sort key of a fitting layout (smallest first) under `prefer` (module docstring)."""
    if prefer not in PREFER:
        raise ValueError(f"prefer: one of {', '.join(PREFER)}, got {prefer!r}")
    lo, recomputes = layout, step.recompute_mode != "none"
    key = (lo.model_parallel, lo.pp, lo.cp, recomputes, -micro_batch_size)
    if prefer == "compute":
        return (RECOMPUTE_COST[step.recompute_mode], *key)
    return key


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


# The layout fields `propose(only=...)` may pin (sequence_parallel: False turns it off).
PINNABLE = ("tp", "pp", "cp", "ep", "etp", "sequence_parallel")


def candidate_layouts(shape: ModelShape, world: int, gpus_per_node: int, seq_len: int, only=None):
    """Every ParallelLayout the model can train on over `world` GPUs (module docstring): tp
    within a node, pp dividing the layers, cp a power of two (seq_len a multiple of 2 cp), the
    fields of `only` pinned, sequence parallelism wherever tp > 1 (unless pinned off)."""
    only = only or {}
    sp = only.get("sequence_parallel", True)
    experts = dict(ep=only.get("ep", 1), etp=only.get("etp", 1)) if shape.is_moe else {}
    if not shape.is_moe and ("ep" in only or "etp" in only):
        experts = {k: only[k] for k in ("ep", "etp") if k in only}  # refused below, by name
    for tp in _divisors(gpus_per_node):
        for pp in _divisors(shape.num_layers):
            for cp in (1, 2, 4, 8, 16, 32):
                mp = tp * pp * cp
                sizes = {"tp": tp, "pp": pp, "cp": cp}
                if any(sizes[k] != v for k, v in only.items() if k in sizes):
                    continue
                if mp > world or world % mp or seq_len % (2 * cp):
                    continue
                try:
                    layout = ParallelLayout(
                        **sizes, dp=world // mp, **experts, sequence_parallel=sp and tp > 1
                    )
                    layout.check_training(shape)
                except LayoutError:
                    continue
                yield layout


def _fit_micro_batch(shape, base, seq_len, budget, gpu_mem_gib, vllm, max_mbs, fixed):
    """The largest micro-batch size (1..max_mbs) that fits, or 0; with `fixed` (tokens of a
    micro-batch) only that one. `base`: (layout, step settings). Fits: the tensors' peak within
    `budget` (the GPU less the headroom, which stands for what the estimate leaves out and its
    error) and the whole estimate, overheads included, within the GPU."""
    gpu = gpu_mem_gib * GIB
    layout, base_step = base

    def over(e):
        return e.peak > budget or e.total > gpu

    vllm_tp = (vllm.tp if vllm is not None and vllm.tp else None) or layout.tp
    kv_per_seq = kv_cache_bytes_per_token(shape, vllm_tp) * seq_len

    def est(mbs):
        tokens = fixed if fixed else mbs * seq_len
        step = replace(base_step, micro_batch_tokens=tokens)
        return step, estimate(shape, layout, step, gpu_mem_gib=gpu_mem_gib, vllm=vllm)

    step, e = est(1)
    if over(e) or (vllm is not None and e.vllm_kv_cache < kv_per_seq):
        return 0, step, e  # the trainer does not fit, or vLLM cannot hold one sequence's KV cache
    good = (max(1, step.micro_batch_tokens // seq_len), step, e)
    mbs = 2
    while mbs <= max_mbs and not fixed:  # memory grows linearly in the micro-batch: doubling
        step, e = est(mbs)
        if over(e):
            break
        good = (mbs, step, e)
        mbs *= 2
    return good


def _base_step(seq_len, recompute, settings: Settings) -> MemorySettings:
    return MemorySettings(
        seq_len,
        recompute=recompute,
        distributed_optimizer=settings.distributed_optimizer,
        offload=settings.offload,
        cpu_adam=settings.cpu_adam,
        logprobs=settings.logprobs,
        reference=settings.reference,
    )


def _fixed_tokens(settings: Settings, seq_len: int, cp: int) -> int | None:
    """Tokens of a micro-batch the settings fix: M whole sequences, or a token budget per GPU
    (dynamic batching / packing: at most T tokens on each GPU, T x cp before CP splits them; at
    least one whole sequence)."""
    if settings.micro_batch_size:
        return settings.micro_batch_size * seq_len
    if settings.max_tokens_per_gpu:
        return max(settings.max_tokens_per_gpu * cp, seq_len)
    return None


def _check_inputs(nodes, gpus_per_node, gpu_mem_gib, max_response_len, prompt_len, headroom):
    for name, value in (
        ("--nodes", nodes),
        ("--gpus-per-node", gpus_per_node),
        ("--max-response-len", max_response_len),
    ):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if gpu_mem_gib <= 0:
        raise ValueError(f"--gpu-mem: must be > 0 GiB, got {gpu_mem_gib}")
    if prompt_len < 0:
        raise ValueError(f"--prompt-len: must be >= 0, got {prompt_len}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom: must be in [0, 1), got {headroom}")


def _search(shape, world, gpus_per_node, seq_len, sequences, only, settings, fit):
    """(every fitting (layout, step, estimate, mbs), the closest (layout, step, estimate) of all
    tried); `fit(base, limit, fixed)` is _fit_micro_batch with the budget bound."""
    fits, closest = [], None
    for layout in candidate_layouts(shape, world, gpus_per_node, seq_len, only):
        if sequences is not None and sequences % layout.dp:
            continue  # each data-parallel rank takes an equal share of the step's sequences
        limit = None if sequences is None else max(1, sequences // layout.dp)
        for recompute in (False, True) if settings.recompute is None else (settings.recompute,):
            base = (layout, _base_step(seq_len, recompute, settings))
            mbs, step, e = fit(base, limit, _fixed_tokens(settings, seq_len, layout.cp))
            if closest is None or e.total < closest[2].total:
                closest = (layout, step, e)
            if mbs:
                fits.append((layout, step, e, mbs))
                break  # recomputation only when a layout cannot fit without it
    return fits, closest


def _alternatives(fits) -> list[dict]:
    return [
        {
            "tp": a.tp,
            "pp": a.pp,
            "cp": a.cp,
            "dp": a.dp,
            "micro_batch_size": m,
            "recompute": step.recompute,
            "memory_gib_per_gpu": round(ae.total_gib, 2),
        }
        for a, step, ae, m in fits[1:6]
    ]


def propose(
    shape: ModelShape,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gib: float,
    max_response_len: int,
    prompt_len: int = 512,
    group_size: int | None = None,
    prompts_per_step: int | None = None,
    vllm: VLLMShare | None = DEFAULT_VLLM,
    headroom: float = 0.1,
    max_micro_batch: int = 64,
    only: dict[str, int] | None = None,
    settings: Settings = Settings(),
    seq_len: int | None = None,
) -> Plan:
    """The proposal (see the module docstring); `only` pins layout fields (PINNABLE: e.g.
    {"tp": 2, "ep": 8}) to estimate a given layout instead of searching over it; `seq_len`
    (prompt + response) replaces prompt_len + max_response_len."""
    _check_inputs(nodes, gpus_per_node, gpu_mem_gib, max_response_len, prompt_len, headroom)
    if settings.prefer not in PREFER:
        raise ValueError(f"prefer: one of {', '.join(PREFER)}, got {settings.prefer!r}")
    sequences = None
    if group_size is not None and prompts_per_step is not None:
        sequences = group_size * prompts_per_step
    seq_len = seq_len or prompt_len + max_response_len
    seq_len = padded_seq_len(seq_len)
    world = nodes * gpus_per_node
    budget = (1 - headroom) * gpu_mem_gib * GIB
    only = {k: v for k, v in (only or {}).items() if v is not None}
    unknown = set(only) - set(PINNABLE)
    if unknown:
        raise ValueError(f"only: pins {', '.join(PINNABLE)}, not {', '.join(sorted(unknown))}")
    _check_pins(shape, only)

    def fit(base, limit, fixed):
        most = max_micro_batch if limit is None else min(max_micro_batch, limit)
        return _fit_micro_batch(shape, base, seq_len, budget, gpu_mem_gib, vllm, most, fixed)

    fits, closest = _search(shape, world, gpus_per_node, seq_len, sequences, only, settings, fit)
    if not fits:
        if closest is None:
            raise NoLayoutFits(
                f"no TP x PP x CP layout divides {world} GPUs for {shape.name} "
                f"(tp must divide {gpus_per_node} and the {shape.num_query_groups} KV heads)"
            )
        lo, step, e = closest
        mbs = max(1, step.micro_batch_tokens // seq_len)
        plan = Plan(shape, lo, step, e, mbs, seq_len, sequences, nodes, gpus_per_node,
                    gpu_mem_gib, vllm=vllm)  # fmt: skip
        raise NoLayoutFits(
            f"{shape.name} at {seq_len} tokens per sequence does not fit {nodes} x "
            f"{gpus_per_node} GPUs of {gpu_mem_gib} GiB: the closest layout (tp={lo.tp} pp={lo.pp} "
            f"cp={lo.cp}, recompute={step.recompute_mode}) needs {e.total_gib:.1f} GiB per GPU "
            f"({e.peak_gib:.1f} GiB of tensors against {budget / GIB:.1f} GiB usable with the "
            f"headroom{'; ' + plan.verdict.reason if plan.verdict.reason else ''}); add nodes, use "
            f"GPUs with more memory or shorten --max-response-len",
            closest=plan,
        )

    fits.sort(key=lambda item: rank_key(item[0], item[1], item[3], settings.prefer))
    lo, step, e, mbs = fits[0]
    return Plan(shape, lo, step, e, mbs, seq_len, sequences, nodes, gpus_per_node, gpu_mem_gib,
                _alternatives(fits), vllm=vllm)  # fmt: skip


def _check_pins(shape: ModelShape, only: dict) -> None:
    """ValueError naming the flag when the pinned fields alone cannot train `shape` (a layout
    with them and every other field 1, at the pinned sizes' own data parallelism)."""
    pinned = {k: only[k] for k in ("tp", "pp", "cp") if k in only}
    experts = {k: only[k] for k in ("ep", "etp") if k in only}
    dp = (experts.get("ep", 1) * experts.get("etp", 1)) or 1
    try:
        sp = only.get("sequence_parallel", True) and pinned.get("tp", 1) > 1
        layout = ParallelLayout(**pinned, dp=dp, **experts, sequence_parallel=sp)
        layout.check_training(shape)
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None
