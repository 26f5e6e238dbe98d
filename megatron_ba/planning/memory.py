"""Per-GPU memory of a GRPO training step on megatron-core, term by term.

    shape = load_model("Qwen2.5-Math-7B")            # a preset, a config.json, or a folder with one
    est = estimate(shape, ParallelLayout(tp=2, dp=16, sequence_parallel=True),
                   MemorySettings(micro_batch_tokens=8192), gpu_mem_gib=80)
    est.peak_gib, est.breakdown_gib()

The layout is megatron_ba.parallel.parallel_layout.ParallelLayout (its rules are checked there,
against the model too); what the step keeps in memory besides it (the micro-batch,
recomputation, the log-prob path, the optimiser's placement, offload, a reference policy) is
MemorySettings (planning/memory_settings.py, with MemoryEstimate).

The model is the megatron-core mixed-precision recipe the local backend and NeMo use: bf16
weights, the gradient buffers in fp32 (`grad_reduce_in_fp32`, MemorySettings.grad_reduce; bf16
where a framework reduces in bf16), and the distributed optimiser's fp32 master copy plus Adam's
two moments, sharded over the data-parallel ranks (including CP, which megatron-core folds into
the optimiser's sharding group; a mixture of experts' routed experts over expert parallelism and
their own data-parallel group). Everything is bytes per GPU on the worst pipeline stage, in two
phases (training; generation by a colocated engine: planning/generation_memory.py), plus the
overheads (NON_TORCH_GIB, FRAGMENTATION in planning/memory_settings.py: memory outside PyTorch,
the allocator's reserve;
and a colocated engine's own process, generation_memory.ENGINE_PROCESS_GIB).
The figures are estimates with named assumptions; docs/cluster-planning.md checks their verdicts
against public runs that ran or went out of memory (tests/test_public_record.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ba.model_shape import PRESETS, ModelShape, preset
from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout
from megatron_ba.planning.architectures import check_modelled
from megatron_ba.planning.generation_memory import (
    EngineShare,
    VLLMShare,
    engine_process_bytes,
    kv_cache_bytes_per_token,
)
from megatron_ba.planning.logprob_memory import step_phases
from megatron_ba.planning.memory_settings import (
    FRAGMENTATION,
    GIB,
    GRAD_BYTES,
    LOGPROBS,
    NON_TORCH_GIB,
    OFFLOAD,
    OPTIMIZER_STATE_BYTES,
    PRECISION,
    RECOMPUTE,
    MemoryEstimate,
    MemorySettings,
    Precision,
    overhead_bytes,
)

# The estimate's inputs and terms are imported from here by every caller (their types and
# constants live in memory_settings.py and generation_memory.py).
__all__ = [
    "FRAGMENTATION",
    "GIB",
    "GRAD_BYTES",
    "LOGPROBS",
    "NON_TORCH_GIB",
    "OFFLOAD",
    "OPTIMIZER_STATE_BYTES",
    "PRECISION",
    "RECOMPUTE",
    "SEQ_PAD",
    "EngineShare",
    "MemoryEstimate",
    "MemorySettings",
    "Precision",
    "VLLMShare",
    "estimate",
    "in_flight_tokens",
    "kv_cache_bytes_per_token",
    "layer_activations",
    "load_model",
    "overhead_bytes",
    "padded_seq_len",
    "stage_params",
]


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
    optimizer = opt_params * OPTIMIZER_STATE_BYTES[step.optimizer_states] * (1 - step.cpu_adam)
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


def _logits(shape, layout, step, stage, tokens, prec) -> dict[str, float]:
    """Bytes of each log-prob / loss path (LOGPROBS) over this stage's logits."""
    if stage != layout.pp - 1:
        return dict.fromkeys(LOGPROBS, 0.0)
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
    # Transformer Engine's fused cross entropy (megatron-core's cross_entropy_loss_fusion with
    # cross_entropy_fusion_impl "te": transformer_engine/pytorch/triton/cross_entropy.py): its
    # forward writes the gradient into the bf16 logits in place and keeps them for the backward,
    # so a logit costs its own bytes; per token, the fp32 loss and the fp32 (max, sum, target
    # logit) row statistics, all-gathered over TP into tp x 3 more.
    te_rows = 4 + 12 + (12 * layout.tp if layout.tp > 1 else 0)
    te = tokens * (v_local * prec.logits_bytes + te_rows)
    # From Transformer Engine 2.18 (NVIDIA/TransformerEngine 01bbe3eea, "Store the input
    # gradient in FP32 so it is not quantized before backward") the forward writes the gradient
    # into a new fp32 tensor it keeps for the backward: beside the bf16 logits at the kernel,
    # 4 bytes more per logit.
    te_fp32_grad = te + tokens * v_local * 4
    return {"naive": naive, "chunked": chunked, "megatron": megatron, "fp32": fp32, "te": te,
            "te-fp32-grad": te_fp32_grad}  # fmt: skip


def _estimate_stage(shape, layout, step, stage, gpu_mem_gib, vllm, prec, seq_len=None):
    weights, grads, optimizer = _states(shape, layout, step, stage, prec)
    no_recompute, full_recompute, tokens, flight = _activations(shape, layout, step, stage, prec)
    activations = full_recompute if step.recompute_mode == "full" else no_recompute
    by_path = _logits(shape, layout, step, stage, tokens, prec)
    logits = by_path[step.logprob_mode]
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
        logits_naive=by_path["naive"],
        logits_chunked=by_path["chunked"],
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
