"""Propose a TP x PP x CP x DP layout and a micro-batch size that fit a cluster, for GRPO.

    plan = propose(load_model("Qwen2.5-32B"), nodes=8, gpus_per_node=8, gpu_mem_gib=80,
                   max_response_len=12288, group_size=16, prompts_per_step=32)
    plan.layout, plan.step, plan.estimate.peak_gib, plan.overrides(), plan.to_json()  # plan.py
    propose(..., only={"tp": 2, "ep": 8})     # pin fields of the layout (ParallelLayout's)

Search: every tp dividing the GPUs of a node (TP stays inside a node, on NVLink), every pp dividing
the layers or a power of two up to them (a pp that does not divide them splits them as evenly as
megatron-core allows: parallel_layout.balanced_stages; a pinned split is taken as given), cp a
power of two, dp what is left of the world, each a ParallelLayout the model can train on
(parallel_layout: tp divides the heads and the KV heads, a pinned tp may be a multiple of the KV
heads, expert parallelism fits; a mixture of
experts at ep=1 unless pinned, its experts whole on each GPU (etp 1) unless pinned, with sequence
parallelism wherever tp > 1); for each, the largest micro-batch (whole sequences of
prompt_len + max_response_len tokens, padded) that fits by planning.verdict.assess (the one rule
of "fits": the tensors' peak leaves `headroom` of the GPU free, the whole estimate is within it,
vLLM holds one sequence's KV cache), first without activation recomputation, then with it. Among
the layouts that fit one sequence per micro-batch the proposal is, by `Settings.prefer`:

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

from dataclasses import dataclass, replace

from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import (
    FLAGS,
    UNEVEN,
    LayoutError,
    ParallelLayout,
    balanced_stages,
)
from megatron_ba.planning.logprob_memory import logprob_tokens
from megatron_ba.planning.memory import EngineShare, MemorySettings, padded_seq_len
from megatron_ba.planning.plan import NoLayoutFits, Plan  # re-exported: the search's answer
from megatron_ba.planning.verdict import HEADROOM, assess, check_headroom

# A step's compute relative to its model FLOPs (forward 1/3, backward 2/3 of 6 N S): full
# recomputation runs each layer's forward twice; selective (core attention) with flash attention
# recomputes nothing the estimate counts (it keeps what none keeps).
RECOMPUTE_COST = {"none": 1.0, "selective": 1.0, "full": 4 / 3}
PREFER = ("parallelism", "compute")

DEFAULT_VLLM = EngineShare()  # colocated vLLM (the recipe's default share), asleep while training


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
    grad_reduce: str = "fp32"  # MemorySettings.grad_reduce
    optimizer_states: str = "fp32"  # MemorySettings.optimizer_states
    # sequences of one micro-batch of a forward-only log-prob pass (NeMo-RL's
    # logprob_batch_size; planning/logprob_memory.py); None: no pass of its own
    logprob_batch_size: int | None = None
    virtual_pipeline: int = 1  # MemorySettings.virtual_pipeline (pinned layouts of other trainers)


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


# The layout fields `propose(only=...)` may pin (sequence_parallel: False turns it off; the
# uneven stages' layers need a pinned pp).
PINNABLE = ("tp", "pp", "cp", "ep", "etp", "sequence_parallel", *UNEVEN)
CP_VALUES = (1, 2, 4, 8, 16, 32)


def _tried(name: str, values, only: dict, refused: dict, rule: str) -> list[int]:
    """The values of `name` the search tries: `values`, or the pinned one alone (none, and the
    refusal recorded in `refused` under `name`, when it breaks `rule`)."""
    if name not in only:
        return list(values)
    if only[name] in values:
        return [only[name]]
    refused.setdefault(name, f"{FLAGS[name]}: {only[name]} {rule}")
    return []


def _pp_values(num_layers: int, only: dict) -> list[int]:
    """pp the search tries: the divisors of the layers, the powers of two up to them (uneven
    stages), or the pinned pp (ParallelLayout's rules judge it)."""
    if "pp" in only:
        return [only["pp"]]
    twos = {2**i for i in range(num_layers.bit_length()) if 2**i <= num_layers}
    return sorted(set(_divisors(num_layers)) | twos)


def candidate_layouts(
    shape: ModelShape, world: int, gpus_per_node: int, seq_len: int, only=None, refused=None
):
    """Every ParallelLayout the model can train on over `world` GPUs (module docstring): tp
    within a node and, unless pinned, at most the KV heads, pp dividing the layers or a power of
    two (its layers split by the pinned uneven stages, else balanced_stages), cp a power of two
    (seq_len a multiple of 2 cp), the fields of `only` pinned, sequence parallelism wherever
    tp > 1 (unless pinned off).
    `refused` (a dict) collects the first reason each rule refused a candidate, keyed by field."""
    only, refused = only or {}, {} if refused is None else refused
    sp = only.get("sequence_parallel", True)
    experts = dict(ep=only.get("ep", 1), etp=only.get("etp", 1)) if shape.is_moe else {}
    if not shape.is_moe and ("ep" in only or "etp" in only):
        experts = {k: only[k] for k in ("ep", "etp") if k in only}  # refused below, by name
    split = {k: only[k] for k in UNEVEN if k in only}
    node = f"does not divide the {gpus_per_node} GPUs of a node (TP stays inside one)"
    for tp in _tried("tp", _divisors(gpus_per_node), only, refused, node):
        if "tp" not in only and tp > shape.num_query_groups:
            # valid (ParallelLayout: megatron-core gathers a KV head per rank), but the search
            # keeps whole KV heads on each rank rather than all-gather the fused QKV
            refused.setdefault("tp", f"{tp} is searched only up to num_query_groups (pin --tp)")
            continue
        for pp in _pp_values(shape.num_layers, only):
            for cp in _tried("cp", CP_VALUES, only, refused, f"is not one of {CP_VALUES}"):
                sizes, mp = {"tp": tp, "pp": pp, "cp": cp}, tp * pp * cp
                if mp > world or world % mp:
                    refused.setdefault(
                        "world", f"tp*pp*cp = {tp}*{pp}*{cp} does not divide the {world} GPUs"
                    )
                    continue
                if seq_len % (2 * cp):
                    why = f"--cp: {cp} needs sequences of a multiple of {2 * cp} tokens"
                    refused.setdefault("cp", f"{why}, not {seq_len}")
                    continue
                try:
                    stages = split or balanced_stages(shape.num_layers, pp)
                    layout = ParallelLayout(**sizes, dp=world // mp, **experts, **stages,
                                            sequence_parallel=sp and tp > 1)  # fmt: skip
                    layout.check_training(shape)  # Gated DeltaNet: tp x cp divides its heads
                except LayoutError as e:
                    refused.setdefault(e.key, e.renamed(FLAGS))
                    continue
                yield layout


def _fit_micro_batch(shape, base, seq_len, judge, max_mbs, fixed):
    """(the largest micro-batch size, 1..max_mbs, that fits, or 0; its step; its estimate); with
    `fixed` (tokens of a micro-batch) only that one. `base`: (layout, step settings); `judge`:
    (layout, step) -> Verdict, planning.verdict.assess bound to the GPU, vLLM and headroom."""
    layout, base_step = base

    def verdict(mbs):
        tokens = fixed if fixed else mbs * seq_len
        step = replace(base_step, micro_batch_tokens=tokens)
        return step, judge(layout, step)

    step, v = verdict(1)
    if not v.fits:
        return 0, step, v.estimate
    good = (max(1, step.micro_batch_tokens // seq_len), step, v.estimate)
    mbs = 2
    while mbs <= max_mbs and not fixed:  # memory grows linearly in the micro-batch: doubling
        step, v = verdict(mbs)
        if not v.fits:
            break
        good = (mbs, step, v.estimate)
        mbs *= 2
    return good


def _base_step(seq_len, recompute, settings: Settings, sequences=None) -> MemorySettings:
    """The step's settings before its micro-batch is chosen; `sequences` per step (None:
    unknown) fix its tokens, and so the micro-batches 1F1B has in flight."""
    return MemorySettings(
        seq_len,
        recompute=recompute,
        distributed_optimizer=settings.distributed_optimizer,
        offload=settings.offload,
        cpu_adam=settings.cpu_adam,
        logprobs=settings.logprobs,
        reference=settings.reference,
        grad_reduce=settings.grad_reduce,
        optimizer_states=settings.optimizer_states,
        step_tokens=None if sequences is None else sequences * seq_len,
        logprob_tokens=logprob_tokens(settings.logprob_batch_size, seq_len),
        virtual_pipeline=settings.virtual_pipeline,
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
    check_headroom(headroom)


def _search(shape, world, gpus_per_node, seq_len, sequences, only, settings, fit):
    """(every fitting (layout, step, estimate, mbs), the closest (layout, step, estimate) of all
    tried, what refused candidates: {field: reason}); `fit(base, limit, fixed)` is
    _fit_micro_batch with the verdict bound."""
    fits, closest, refused = [], None, {}
    for layout in candidate_layouts(shape, world, gpus_per_node, seq_len, only, refused):
        if sequences is not None and sequences % layout.dp:
            # each data-parallel rank takes an equal share of the step's sequences
            refused.setdefault(
                "sequences",
                f"--group-size x --prompts-per-step: {sequences} sequences per step do not "
                f"split evenly over dp={layout.dp}",
            )
            continue
        limit = None if sequences is None else max(1, sequences // layout.dp)
        for recompute in (False, True) if settings.recompute is None else (settings.recompute,):
            base = (layout, _base_step(seq_len, recompute, settings, sequences))
            mbs, step, e = fit(base, limit, _fixed_tokens(settings, seq_len, layout.cp))
            if closest is None or e.total < closest[2].total:
                closest = (layout, step, e)
            if mbs:
                fits.append((layout, step, e, mbs))
                break  # recomputation only when a layout cannot fit without it
    return fits, closest, refused


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
    vllm: EngineShare | None = DEFAULT_VLLM,
    headroom: float = HEADROOM,
    max_micro_batch: int = 64,
    only: dict[str, int] | None = None,
    settings: Settings = Settings(),
    seq_len: int | None = None,
) -> Plan:
    """The proposal (see the module docstring); `only` pins layout fields (PINNABLE: e.g.
    {"tp": 2, "ep": 8}) to estimate a given layout instead of searching over it; `seq_len`
    (prompt + response) replaces prompt_len + max_response_len; `headroom`: the verdict's
    (planning.verdict.assess). ValueError naming the flag for a pin the model refuses;
    NoLayoutFits when nothing fits."""
    _check_inputs(nodes, gpus_per_node, gpu_mem_gib, max_response_len, prompt_len, headroom)
    if settings.prefer not in PREFER:
        raise ValueError(f"prefer: one of {', '.join(PREFER)}, got {settings.prefer!r}")
    sequences = None
    if group_size is not None and prompts_per_step is not None:
        sequences = group_size * prompts_per_step
    seq_len = seq_len or prompt_len + max_response_len
    seq_len = padded_seq_len(seq_len)
    world = nodes * gpus_per_node
    only = {k: v for k, v in (only or {}).items() if v is not None}
    unknown = set(only) - set(PINNABLE)
    if unknown:
        raise ValueError(f"only: pins {', '.join(PINNABLE)}, not {', '.join(sorted(unknown))}")
    _check_pins(shape, only)

    def judge(layout, step):
        return assess(shape, layout, step, gpu_mem_gib=gpu_mem_gib, vllm=vllm, seq_len=seq_len,
                      headroom=headroom)  # fmt: skip

    def fit(base, limit, fixed):
        most = max_micro_batch if limit is None else min(max_micro_batch, limit)
        return _fit_micro_batch(shape, base, seq_len, judge, most, fixed)

    found = _search(shape, world, gpus_per_node, seq_len, sequences, only, settings, fit)
    fits, closest, refused = found
    cluster = dict(nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib)
    if not fits:
        raise _nothing_fits(shape, seq_len, sequences, cluster, vllm, headroom, closest, refused)
    fits.sort(key=lambda item: rank_key(item[0], item[1], item[3], settings.prefer))
    lo, step, e, mbs = fits[0]
    return Plan(shape, lo, step, e, mbs, seq_len, sequences, **cluster,
                alternatives=_alternatives(fits), vllm=vllm, headroom=headroom)  # fmt: skip


def _nothing_fits(shape, seq_len, sequences, cluster, vllm, headroom, closest, refused):
    """The NoLayoutFits of a search that found nothing: what refused every candidate layout
    (each rule's first refusal), or the closest layout's verdict."""
    nodes, gpus = cluster["nodes"], cluster["gpus_per_node"]
    if closest is None:
        why = "; ".join(refused.values()) or "no candidate"
        return NoLayoutFits(
            f"no TP x PP x CP layout of {nodes} x {gpus} GPUs can train {shape.name}: {why}"
        )
    lo, step, e = closest
    mbs = max(1, step.micro_batch_tokens // seq_len)
    plan = Plan(shape, lo, step, e, mbs, seq_len, sequences, **cluster, vllm=vllm,
                headroom=headroom)  # fmt: skip
    return NoLayoutFits(
        f"{shape.name} at {seq_len} tokens per sequence does not fit {nodes} x {gpus} GPUs of "
        f"{cluster['gpu_mem_gib']} GiB: the closest layout ({lo}, recompute="
        f"{step.recompute_mode}) {plan.verdict.reason}; add nodes, use GPUs with more memory "
        "or shorten --max-response-len",
        closest=plan,
    )


def _check_pins(shape: ModelShape, only: dict) -> None:
    """ValueError naming the flag when the pinned fields alone cannot train `shape` (a layout
    with them and every other field 1, at the pinned sizes' own data parallelism; a pinned pp
    without a pinned split splits the layers as the search would: balanced_stages)."""
    pinned = {k: only[k] for k in ("tp", "pp", "cp", *UNEVEN) if k in only}
    experts = {k: only[k] for k in ("ep", "etp") if k in only}
    dp = (experts.get("ep", 1) * experts.get("etp", 1)) or 1
    for name in UNEVEN:
        if name in pinned and "pp" not in pinned:
            raise ValueError(f"{FLAGS[name]}: needs --pp (the stages of a given pipeline)")
    try:
        if "pp" in pinned and not any(k in pinned for k in UNEVEN):
            pinned |= balanced_stages(shape.num_layers, pinned["pp"])
        sp = only.get("sequence_parallel", True) and pinned.get("tp", 1) > 1
        layout = ParallelLayout(**pinned, dp=dp, **experts, sequence_parallel=sp)
        layout.check_training(shape)
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None
