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
weights, the gradient buffers in fp32 (`grad_reduce_in_fp32`, MemorySettings.grad_reduce; bf16
where a framework reduces in bf16), and the distributed optimiser's fp32 master copy plus Adam's
two moments, sharded over the data-parallel ranks (including CP, which megatron-core folds into
the optimiser's sharding group; a mixture of experts' routed experts over expert parallelism and
their own data-parallel group). Everything is bytes per GPU on the worst pipeline stage, in two
phases (training; generation by a colocated engine: planning/generation_memory.py), plus the
overheads (NON_TORCH_GIB, FRAGMENTATION below: memory outside PyTorch, the allocator's reserve;
and a colocated engine's own process, generation_memory.ENGINE_PROCESS_GIB).
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
from megatron_ba.planning.generation_memory import EngineShare as EngineShare  # re-exported
from megatron_ba.planning.generation_memory import VLLMShare as VLLMShare
from megatron_ba.planning.generation_memory import engine_process_bytes
from megatron_ba.planning.generation_memory import (
    kv_cache_bytes_per_token as kv_cache_bytes_per_token,
)
from megatron_ba.planning.logprob_memory import step_phases


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


# Bytes per parameter of megatron-core's gradient buffer (DDP's main_grad): fp32 with
# DistributedDataParallelConfig(grad_reduce_in_fp32=True), else the parameters' dtype (bf16).
# "fp32" is the mixed-precision recipe: Megatron-LM's validate_args sets
# accumulate_allreduce_grads_in_fp32 for bf16 ("bfloat16 requires gradient accumulation and
# all-reduce to be done in fp32", megatron/training/arguments.py) and this project's trainer sets
# grad_reduce_in_fp32=True (megatron_ba/megatron/model.py build_model_chunks, optimizer_choice.py
# ddp_overrides). NeMo-RL's megatron config reduces in bf16 (grad_reduce_in_fp32: false).
GRAD_BYTES = {"fp32": 4, "bf16": 2}
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
    grad_reduce: str = "fp32"  # the gradient buffer's dtype (GRAD_BYTES): "fp32" or "bf16"
    # Tokens of one optimiser step over every data-parallel rank (its sequences x their padded
    # length): a rank's share, in micro-batches, gives the micro-batches 1F1B has in flight
    # (in_flight_tokens). None: unknown (p - s in flight).
    step_tokens: int | None = None
    # Tokens of one micro-batch of the forward-only log-prob pass before training (NeMo-RL's
    # logprob_batch_size sequences: planning/logprob_memory.py), before CP splits them. None: no
    # pass of its own (this project's trainer computes log-probs in its training micro-batches).
    logprob_tokens: int | None = None
    # Model chunks per pipeline rank of megatron-core's interleaved 1F1B (virtual pipeline
    # stages; in_flight_tokens): the planner estimates other frameworks' runs with it, this
    # project's trainer runs one chunk per rank (1).
    virtual_pipeline: int = 1

    def __post_init__(self) -> None:
        if self.recompute_mode not in RECOMPUTE:
            raise ValueError(f"--recompute: one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.logprob_mode not in LOGPROBS:
            raise ValueError(f"--logprobs: one of {', '.join(LOGPROBS)}, got {self.logprobs!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"--offload: one of {', '.join(OFFLOAD)}, got {self.offload!r}")
        if not 0 <= self.cpu_adam <= 1:
            raise ValueError(f"--offload cpu-adam=F: F must be in [0, 1], got {self.cpu_adam}")
        if self.grad_reduce not in GRAD_BYTES:
            raise ValueError(
                f"--grad-reduce: one of {', '.join(GRAD_BYTES)}, got {self.grad_reduce!r}"
            )
        if not (isinstance(self.virtual_pipeline, int) and self.virtual_pipeline >= 1):
            raise ValueError(f"--vp: must be an integer >= 1, got {self.virtual_pipeline!r}")
        if self.logprob_tokens is not None and self.logprob_tokens < 1:
            raise ValueError(f"--logprob-batch-size: {self.logprob_tokens} tokens; must be >= 1")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(
                f"--group-size x --prompts-per-step: {self.step_tokens} tokens per step; a step "
                "needs at least one sequence"
            )

    @property
    def logprob_mode(self) -> str:
        return self.logprobs if self.chunked_logprobs else "naive"

    @property
    def recompute_mode(self) -> str:
        if isinstance(self.recompute, bool):
            return "full" if self.recompute else "none"
        return self.recompute


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
    vllm_train_phase: float  # the engine's pool while the policy trains (an engine awake)
    vllm_kv_cache: float  # what the engine's pool leaves for the KV cache after its weights
    train_phase: float  # weights + grads + optimizer + activations + logits + vllm_train_phase
    generate_phase: float  # the larger of the refit's instant and generation (generation_memory)
    peak: float
    worst_stage: int
    reference: float = 0.0  # a reference policy's weights kept on the GPU
    overhead: float = 0.0  # CUDA context, NCCL buffers, fragmentation, the engine's process
    total: float = 0.0  # peak + overhead: what the GPU must hold
    peak_phase: str = "train"  # "train", "generate" or "logprob"
    engine_pool: float = 0.0  # the engine's key x the GPU while it generates
    engine_weights: float = 0.0  # the engine's weights, inside its pool
    refit_bucket: float = 0.0  # the refit's bucket (generation_memory)
    refit_full_param: float = 0.0  # the refit's one full tensor
    refit_phase: float = 0.0  # the refit's instant (in generate_phase's max)
    engine_process: float = 0.0  # the engine's own process outside its pool (in overhead)
    in_flight: int = 0  # micro-batches 1F1B holds at the worst stage before its first backward
    in_flight_tokens: float = 0  # their tokens, before CP splits them (/ V interleaved)
    logprob_logits: float = 0.0  # the log-prob pass's logits path (planning/logprob_memory.py)
    logprob_phase: float = 0.0  # the log-prob pass's peak (0: no pass of its own)
    # What one sequence takes in the engine's KV cache (generation_memory.sequence_cache_bytes;
    # 0 when the estimate is not given the sequence's length): its full-attention layers' keys
    # and values, which grow with its tokens, and its Gated DeltaNet layers' recurrent and
    # convolution states, which do not; and how many such sequences the KV cache holds at once.
    engine_kv_per_sequence: float = 0.0
    engine_linear_state_per_sequence: float = 0.0
    engine_conv_state_per_sequence: float = 0.0
    engine_sequences: int = 0

    def breakdown_gib(self) -> dict[str, float]:
        skip = ("worst_stage", "peak_phase", "in_flight", "in_flight_tokens", "engine_sequences")
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
    first = layout.layer_offset(shape.num_layers, stage)
    indices = range(first, first + layout.stage_layers(shape.num_layers)[stage])
    n_exp = sum(shape.layer_expert_params(i) for i in indices)  # each layer by its type
    n = sum(shape.layer_dense_params(i) for i in indices)
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
    vllm: EngineShare | None = None,
    precision: Precision = PRECISION,
    seq_len: int | None = None,
) -> MemoryEstimate:
    """The per-GPU estimate of the worst pipeline stage (the larger of its phases' peaks);
    `seq_len`: the sequence the engine's per-sequence terms describe (None: those are 0).
    ValueError naming the flag when `layout` cannot train `shape` (ParallelLayout's rules: a pp
    that does not divide the layers needs the layout's uneven stages; Gated DeltaNet layers
    train at cp 1)."""
    try:
        layout.check_training(shape)
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None
    best = None
    for stage in range(layout.pp):
        est = _estimate_stage(shape, layout, step, stage, gpu_mem_gib, vllm, precision, seq_len)
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
    return params * prec.param_bytes, params * GRAD_BYTES[step.grad_reduce], optimizer


def in_flight_tokens(step: MemorySettings, layout: ParallelLayout, stage: int) -> tuple[int, float]:
    """(micro-batches, their tokens) 1F1B has in flight on `stage` before its first backward:
    min(pp - stage, the micro-batches of a data-parallel rank's share of the step), each with
    its own tokens (the share's last micro-batch holds what is left of it); pp - stage full
    micro-batches when the step's size is unknown (step_tokens None).

    With V virtual stages per rank (megatron-core's interleaved schedule, schedules.py
    forward_backward_pipelining_with_interleaving) the stage runs chunks of 1/V of its layers:
    it holds (pp - stage - 1) x 2 + (V - 1) x pp warm-up chunk micro-batches plus the one of
    its first steady step (at most every chunk of every micro-batch), chunk k being micro-batch
    (k // (g V)) g + k % g, g = pp (or the rank's micro-batches, when fewer). The count returned
    is of those chunk micro-batches, the tokens theirs / V: the stage's whole layers' worth (on
    the first stage about 1 + 1/V - 1/(pp V) times what the plain schedule holds)."""
    mbt, pp, v = step.micro_batch_tokens, layout.pp, step.virtual_pipeline
    if step.step_tokens is None:
        share, micro_batches = None, None
    else:
        share = -(-step.step_tokens // layout.dp)  # a rank's tokens (the search: an equal share)
        micro_batches = -(-share // mbt)

    def tokens_of(i: int) -> int:  # micro-batch i's tokens (the last holds what is left)
        return mbt if share is None else min(mbt, share - i * mbt)

    if v == 1:
        count = pp - stage if micro_batches is None else min(pp - stage, micro_batches)
        return count, sum(tokens_of(i) for i in range(count))
    chunks = (pp - stage - 1) * 2 + (v - 1) * pp + 1
    group = pp  # micro-batches per chunk in turn (microbatch_group_size_per_vp_stage)
    if micro_batches is not None:
        chunks, group = min(chunks, micro_batches * v), min(pp, micro_batches)
    ids = [(k // (group * v)) * group + k % group for k in range(chunks)]
    return chunks, sum(tokens_of(i) for i in ids) / v


def layer_activations(
    shape: ModelShape, layout: ParallelLayout, prec: Precision, n: float, index: int | None = None
):
    """Layer `index`'s saved activations for n tokens per GPU (None: the model's largest layer,
    ModelShape.layer_activation_elements)."""
    t = layout.tp
    out = shape.layer_activation_elements(index) * prec.act_bytes * n
    out /= t  # TP shards heads and the MLP; sequence parallelism shards the rest
    if t > 1 and not layout.sequence_parallel:
        out += 4 * shape.hidden_size * prec.act_bytes * n * (1 - 1 / t)
    groups = shape.num_query_groups
    if t > groups and not (index is not None and shape.is_linear_attention_layer(index)):
        # tp above the KV heads: each rank keeps its group's whole KV head, k and v, for the
        # core attention (megatron-core's get_query_key_value_tensors), not 2 kv / t
        out += 2 * shape.head_dim * prec.act_bytes * n * (1 - groups / t)
    return out


def _activations(shape, layout, step, stage, prec):
    """(no recompute, full recompute, the micro-batch's tokens per GPU, (in flight, their
    tokens)) of one stage: 1F1B holds in_flight_tokens' micro-batches before its first
    backward."""
    t, c = layout.tp, layout.cp
    tokens = step.micro_batch_tokens / c  # CP splits every sequence across c ranks
    layers = layout.stage_layers(shape.num_layers)[stage]
    first = layout.layer_offset(shape.num_layers, stage)
    flight = in_flight_tokens(step, layout, stage)
    held = flight[1] / c  # the in-flight micro-batches' tokens on this GPU

    def per_layer(n, index):
        return layer_activations(shape, layout, prec, n, index)

    # each layer by its type (a hybrid model's Gated DeltaNet and full-attention layers differ)
    indices = range(first, first + layers)
    no_recompute = sum(per_layer(held, i) for i in indices)
    kept_inputs = shape.hidden_size * prec.act_bytes * held / (t if layout.sequence_parallel else 1)
    redone = max(per_layer(tokens, i) for i in indices)  # the stage's largest layer being redone
    full_recompute = layers * kept_inputs + redone
    return no_recompute, full_recompute, tokens, flight


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


def _estimate_stage(shape, layout, step, stage, gpu_mem_gib, vllm, prec, seq_len=None):
    weights, grads, optimizer = _states(shape, layout, step, stage, prec)
    no_recompute, full_recompute, tokens, flight = _activations(shape, layout, step, stage, prec)
    activations = full_recompute if step.recompute_mode == "full" else no_recompute
    naive, chunked, megatron, fp32 = _logits(shape, layout, step, stage, tokens, prec)
    logits = {"naive": naive, "chunked": chunked, "megatron": megatron, "fp32": fp32}[
        step.logprob_mode
    ]
    reference = weights if step.reference else 0.0  # sharded as the policy
    parts = (weights, grads, optimizer, activations, logits, reference)
    p = step_phases(shape, layout, step, stage, gpu_mem_gib * GIB, vllm, parts,
                    lambda n: layer_activations(shape, layout, prec, n), seq_len)  # fmt: skip
    gen = p["gen"]
    held = gen.pop("held")
    # the engine's memory (its pool, or its weights) is its own, outside the trainer's allocator
    engine_own = held if p["peak_phase"] == "generate" else gen["vllm_train_phase"]
    process = engine_process_bytes(vllm)
    overhead = overhead_bytes(p["peak"] - engine_own) + process
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
        train_phase=p["train"],
        peak=p["peak"],
        worst_stage=stage,
        reference=reference,
        overhead=overhead,
        total=p["peak"] + overhead,
        peak_phase=p["peak_phase"],
        engine_process=process,
        in_flight=flight[0],
        in_flight_tokens=flight[1],
        logprob_logits=p["lp_logits"],
        logprob_phase=p["lp"],
        **gen,
    )
