"""Per-GPU memory of a GRPO training step on megatron-core, term by term.

    shape = load_model("Qwen2.5-Math-7B")            # a preset, a config.json, or a folder with one
    est = estimate(shape, ParallelLayout(tp=2, dp=16, sequence_parallel=True),
                   MemorySettings(micro_batch_tokens=8192), gpu_mem_gib=80)
    est.peak_gib, est.breakdown_gib()

The layout is megatron_ba.parallel.parallel_layout.ParallelLayout (its rules are checked there,
against the model too); what the step keeps in memory besides it (the micro-batch,
recomputation, the log-prob path, the optimiser's placement, offload, a reference policy) is
MemorySettings.

The model is the megatron-core mixed-precision recipe the local backend and NeMo use: bf16
weights, fp32 gradient buffers (grads are reduced in fp32), and the distributed optimiser's fp32
master copy plus Adam's two moments, sharded over the data-parallel ranks (including CP, which
megatron-core folds into the optimiser's sharding group; a mixture of experts' routed experts
over expert parallelism and their own data-parallel group). Everything is bytes per GPU on the
worst pipeline stage, in two phases (training; generation by a colocated vLLM), plus the
overheads (NON_TORCH_GIB, FRAGMENTATION below: memory outside PyTorch, the allocator's reserve).
The figures are estimates with named assumptions; docs/cluster-planning.md checks their verdicts
against public runs that ran or went out of memory (tests/test_public_record.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ba.model_shape import PRESETS, ModelShape, preset
from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout
from megatron_ba.planning.architectures import check_modelled
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION


def load_model(name_or_path: str) -> ModelShape:
    """A preset (case-insensitive, `Qwen/` prefix allowed) or an HF config.json (or its folder)."""
    if not Path(name_or_path).exists():
        try:
            return preset(name_or_path)
        except KeyError:
            pass
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {name_or_path}: neither a preset ({', '.join(PRESETS)}) nor a config.json"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path}: not JSON ({e})") from None
    check_modelled(cfg, f"--model {name_or_path}")
    return ModelShape.from_hf_config(cfg, name=str(name_or_path))


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # fp32 gradient buffer (megatron-core reduces gradients in fp32)
    optimizer_bytes: int = 12  # fp32 master weights + Adam m + Adam v, sharded over DP x CP
    act_bytes: int = 2  # bf16 activations
    logits_bytes: int = 2  # bf16 logits out of the output layer


PRECISION = Precision()


GIB = 1024**3

# The overhead terms are physical, the same for every run (never fitted to one case), read off
# two out-of-memory messages of megatron-core trainer processes that print the split:
# * memory outside PyTorch's allocator (CUDA context, NCCL's communicator buffers, cuBLAS / TE
#   workspaces): NON_TORCH_GIB per process, the mean of the two.
#   https://github.com/THUDM/slime/issues/1767 (H100): 48.84 GiB in use by the trainer, 44.61
#   allocated by PyTorch, 0.40 reserved and unallocated: 3.83 GiB outside;
#   https://github.com/THUDM/slime/issues/1951 (H200): 88.83 in use, 82.55 allocated, 2.06
#   reserved: 4.22 GiB outside.
# * the caching allocator's reserved-but-unallocated memory: FRAGMENTATION of what PyTorch holds
#   (the same messages: 0.40 of 45.0 GiB, 2.06 of 84.6 GiB; the larger, 2.4 %, rounded up).
NON_TORCH_GIB = (3.83 + 4.22) / 2
FRAGMENTATION = 0.025


def overhead_bytes(torch_bytes: float) -> float:
    """NON_TORCH_GIB + FRAGMENTATION of the `torch_bytes` PyTorch's allocator holds."""
    return NON_TORCH_GIB * GIB + FRAGMENTATION * torch_bytes


RECOMPUTE = ("none", "selective", "full")
LOGPROBS = ("chunked", "megatron", "fp32", "naive")
OFFLOAD = ("auto", "none", "states")


@dataclass(frozen=True)
class MemorySettings:
    """What a training step keeps in memory besides the layout decides; a bad value raises
    ValueError naming the flag of `megatron-ba layout`."""

    micro_batch_tokens: int  # tokens of one micro-batch of one model replica, before CP splits it
    # "none", "selective" (megatron-core's core-attention recompute: with flash attention it
    # keeps what "none" keeps) or "full" (keep each layer's input, redo the layer); True / False
    # are "full" / "none".
    recompute: bool | str = False
    chunked_logprobs: bool = True  # megatron_ba.megatron.vocab_parallel's chunked path
    logprob_chunk: int = 1024  # its tokens per chunk
    distributed_optimizer: bool = True  # optimiser states sharded over DP x CP
    # What the trainer keeps on the GPU while a colocated engine generates: "auto" (its weights
    # while the engine sleeps, everything when it stays awake), "none" (nothing is offloaded:
    # weights, gradients, optimiser stay: verl's offload off), "states" (weights, gradients and
    # optimiser go to the CPU between phases and come back for the update: verl's offload on).
    offload: str = "auto"
    cpu_adam: float = 0.0  # the fraction of the optimiser megatron's hybrid CPU Adam keeps on CPU
    reference: bool = False  # a reference policy's bf16 weights stay on the GPU (KL loss)
    # The log-prob / loss path over the vocabulary: "chunked" (this project's), "megatron"
    # (megatron-core's vocab-parallel cross entropy: an fp32 softmax), "fp32" (NeMo-RL's
    # DistributedLogprob on the model's fp32 logits), "naive" (autograd's log_softmax of fp32
    # logits); chunked_logprobs=False means "naive".
    logprobs: str = "chunked"

    def __post_init__(self) -> None:
        if self.recompute_mode not in RECOMPUTE:
            raise ValueError(f"--recompute: one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.logprob_mode not in LOGPROBS:
            raise ValueError(f"--logprobs: one of {', '.join(LOGPROBS)}, got {self.logprobs!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"--offload: one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if not 0 <= self.cpu_adam <= 1:
            raise ValueError(f"--offload cpu-adam=F: F must be in [0, 1], got {self.cpu_adam}")

    @property
    def logprob_mode(self) -> str:
        return self.logprobs if self.chunked_logprobs else "naive"

    @property
    def recompute_mode(self) -> str:
        if isinstance(self.recompute, bool):
            return "full" if self.recompute else "none"
        return self.recompute


@dataclass(frozen=True)
class VLLMShare:
    """A colocated vLLM engine: it reserves `gpu_util` of the GPU while it generates; with
    `sleeps` (NeMo-RL's and verl's colocated mode) it frees that memory while the policy trains,
    and the trainer keeps only its weights on the GPU during generation (gradients and optimiser
    states offloaded), else everything of both stays."""

    gpu_util: float = VLLM_GPU_MEMORY_UTILIZATION  # the recipe's rollout.gpu_memory_utilization
    sleeps: bool = True  # the recipe's rollout.sleep
    tp: int | None = None  # the engine's tensor parallelism (None: the trainer's tp)


@dataclass
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float  # the variant the layout uses (recompute or not)
    activations_no_recompute: float
    activations_full_recompute: float
    logits: float  # the variant the layout uses (chunked or not)
    logits_naive: float
    logits_chunked: float
    vllm_train_phase: float
    vllm_kv_cache: float  # what vLLM's reservation leaves for the KV cache after its weights
    train_phase: float  # weights + grads + optimizer + activations + logits + vllm_train_phase
    generate_phase: float  # what the trainer keeps while vLLM generates, + vLLM's reservation
    peak: float
    worst_stage: int
    reference: float = 0.0  # a reference policy's weights kept on the GPU
    overhead: float = 0.0  # CUDA context, NCCL buffers, fragmentation (overhead_bytes)
    total: float = 0.0  # peak + overhead: what the GPU must hold
    peak_phase: str = "train"  # "train" or "generate"

    def breakdown_gib(self) -> dict[str, float]:
        skip = ("worst_stage", "peak_phase")
        return {k: round(v / GIB, 3) for k, v in asdict(self).items() if k not in skip}

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    @property
    def total_gib(self) -> float:
        return self.total / GIB


# Sequences as the planner counts them: padded to a multiple of 64 tokens, as megatron_ba's
# batching pads them (and so a multiple of 2 cp for every cp the planner proposes).
SEQ_PAD = 64


def padded_seq_len(tokens: int) -> int:
    """`tokens` (prompt + response) as the planner counts a sequence: padded to SEQ_PAD."""
    return tokens + -tokens % SEQ_PAD


def stage_params(
    shape: ModelShape, layout: ParallelLayout, stage: int, experts: bool | None = None
) -> int:
    """Parameters held by pipeline `stage`: its layers (the layout's split,
    ParallelLayout.stage_layers: uneven stages hold what the layout gives them), the embedding on
    the first, the output layer (or, tied, its copy of the embedding) and the final norm on the
    last. experts: True for only the routed experts' parameters, False for all the others, None
    for both."""
    pp = layout.pp
    layers = layout.stage_layers(shape.num_layers)[stage]
    n_exp = layers * shape.layer_expert_params()
    n = layers * shape.layer_dense_params()
    if stage == 0:
        n += shape.embedding_params()
    if stage == pp - 1:
        n += shape.hidden_size + (
            shape.head_params() or (shape.embedding_params() if pp > 1 else 0)
        )
    return {True: n_exp, False: n, None: n + n_exp}[experts]


def estimate(
    shape: ModelShape,
    layout: ParallelLayout,
    step: MemorySettings,
    *,
    gpu_mem_gib: float,
    vllm: VLLMShare | None = None,
    precision: Precision = PRECISION,
) -> MemoryEstimate:
    """The per-GPU estimate of the worst pipeline stage (the larger of its phases' peaks).
    ValueError naming the flag when `layout` cannot train `shape` (ParallelLayout's rules: a pp
    that does not divide the layers needs the layout's uneven stages)."""
    try:
        layout.check_training(shape)
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None
    best = None
    for stage in range(layout.pp):
        est = _estimate_stage(shape, layout, step, stage, gpu_mem_gib, vllm, precision)
        if best is None or est.total > best.total:
            best = est
    return best


def _states(shape, layout, step, stage, prec):
    """Weights, gradients and the optimiser's GPU part of one stage, per GPU."""
    t, c, d = layout.tp, layout.cp, layout.dp
    dense = stage_params(shape, layout, stage, experts=False) / t  # TP shards every matrix
    # the routed experts: split over EP, each expert's matrices over expert TP
    experts = stage_params(shape, layout, stage, experts=True) / (layout.ep * layout.expert_tp)
    params = dense + experts
    if step.distributed_optimizer:  # the experts' states over their data-parallel group
        opt_params = dense / (d * c) + experts / layout.expert_dp
    else:
        opt_params = params
    optimizer = opt_params * prec.optimizer_bytes * (1 - step.cpu_adam)
    return params * prec.param_bytes, params * prec.grad_bytes, optimizer


def _activations(shape, layout, step, stage, prec):
    t, p, c = layout.tp, layout.pp, layout.cp
    tokens = step.micro_batch_tokens / c  # CP splits every sequence across c ranks
    layers = layout.stage_layers(shape.num_layers)[stage]
    # 1F1B: stage s has min(p - s, micro-batches) forwards in flight before its first backward;
    # the planner assumes at least p micro-batches per step (it proposes enough).
    in_flight = p - stage
    per_layer = shape.layer_activation_elements() * prec.act_bytes * tokens
    per_layer /= t  # TP shards heads and the MLP; sequence parallelism shards the rest
    if t > 1 and not layout.sequence_parallel:
        per_layer += 4 * shape.hidden_size * prec.act_bytes * tokens * (1 - 1 / t)
    no_recompute = in_flight * layers * per_layer
    kept_inputs = (
        shape.hidden_size * prec.act_bytes * tokens / (t if layout.sequence_parallel else 1)
    )
    full_recompute = in_flight * layers * kept_inputs + per_layer  # + one layer being redone
    return no_recompute, full_recompute, tokens


def _logits(shape, layout, step, stage, tokens, prec):
    """(naive, chunked, megatron, fp32) bytes of the log-prob path on this stage."""
    if stage != layout.pp - 1:
        return 0.0, 0.0, 0.0, 0.0
    v_local = shape.vocab_size / layout.tp
    # naive (log_softmax of the fp32 logits through autograd): the bf16 logits plus 20 bytes
    # per logit of fp32 saved tensors and the gradient, as measured (docs/performance.md,
    # "Vocab-parallel log-prob": 5935 MiB extra at T 16,384 x V/TP 18,992).
    naive = tokens * v_local * (prec.logits_bytes + 20)
    # chunked: the bf16 logits and their gradient, two fp32 chunk buffers of C x V/t (742 MiB
    # extra measured at C 1024 there: 594 MiB gradient + 2 x 1024 x 18,992 x 4 bytes).
    chunk = min(step.logprob_chunk, tokens)
    chunked = tokens * v_local * 2 * prec.logits_bytes + 2 * chunk * v_local * 4
    # megatron-core's vocab_parallel_cross_entropy: the bf16 logits, their fp32 softmax kept for
    # the backward (which turns it into the gradient in place), the bf16 gradient it returns.
    megatron = tokens * v_local * (prec.logits_bytes + 4 + prec.logits_bytes)
    # NeMo-RL's unchunked path (DistributedLogprob, from NeMo-Aligner; nemo_rl/distributed/
    # model_utils.py) on the fp32 logits the model returns unless defer_fp32_logits (the bf16
    # ones are freed by the cast): at its peak three fp32 tensors of the logits' size live at
    # once: the fp32 logits, their max-shifted copy and its exp (summed), then the fp32 logits,
    # the log-softmax and its exp, the softmax saved for the backward.
    fp32 = tokens * v_local * 3 * 4
    return naive, chunked, megatron, fp32


def _estimate_stage(shape, layout, step, stage, gpu_mem_gib, vllm, prec) -> MemoryEstimate:
    weights, grads, optimizer = _states(shape, layout, step, stage, prec)
    no_recompute, full_recompute, tokens = _activations(shape, layout, step, stage, prec)
    activations = full_recompute if step.recompute_mode == "full" else no_recompute
    naive, chunked, megatron, fp32 = _logits(shape, layout, step, stage, tokens, prec)
    logits = {"naive": naive, "chunked": chunked, "megatron": megatron, "fp32": fp32}[
        step.logprob_mode
    ]

    gpu = gpu_mem_gib * GIB
    reserved = vllm.gpu_util * gpu if vllm is not None else 0.0
    # vLLM's engine shards the whole model over the same tp (every stage's weights: vLLM does not
    # pipeline here), and keeps what its reservation leaves for the KV cache.
    vllm_tp = (vllm.tp if vllm is not None and vllm.tp else None) or layout.tp
    vllm_weights = shape.total_params() / vllm_tp * prec.param_bytes
    kv_cache = max(0.0, reserved - vllm_weights) if vllm is not None else 0.0
    vllm_train = 0.0 if (vllm is None or vllm.sleeps) else reserved
    reference = weights if step.reference else 0.0  # sharded as the policy
    train_phase = weights + grads + optimizer + activations + logits + vllm_train + reference
    kept = {"none": weights + grads + optimizer, "states": 0.0}.get(step.offload)
    if kept is None:  # auto
        kept = weights if (vllm is None or vllm.sleeps) else weights + grads + optimizer
    generate_phase = 0.0 if vllm is None else kept + reserved + reference
    peak = max(train_phase, generate_phase)
    # vLLM's reservation is its own pool, outside PyTorch's caching allocator
    overhead = overhead_bytes(peak - (reserved if peak == generate_phase else vllm_train))
    return MemoryEstimate(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        activations_no_recompute=no_recompute,
        activations_full_recompute=full_recompute,
        logits=logits,
        logits_naive=naive,
        logits_chunked=chunked,
        vllm_train_phase=vllm_train,
        vllm_kv_cache=kv_cache,
        train_phase=train_phase,
        generate_phase=generate_phase,
        peak=peak,
        worst_stage=stage,
        reference=reference,
        overhead=overhead,
        total=peak + overhead,
        peak_phase="train" if train_phase >= generate_phase else "generate",
    )


def kv_cache_bytes_per_token(shape: ModelShape, tp: int, kv_bytes: int = 2) -> float:
    """vLLM's KV cache per token on one GPU of a TP-`tp` engine (keys and values, every layer)."""
    kv_heads_local = max(1, shape.num_query_groups // tp)  # vLLM replicates when tp > kv
    return 2 * shape.num_layers * kv_heads_local * shape.head_dim * kv_bytes
