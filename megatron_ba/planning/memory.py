"""Per-GPU memory of a GRPO training step on megatron-core, term by term.

    shape = load_model("Qwen2.5-Math-7B")            # a preset, a config.json, or a folder with one
    est = estimate(shape, Layout(tp=2, pp=1, cp=1, dp=16, micro_batch_tokens=8192), gpu_mem_gib=80)
    est.peak_gib, est.breakdown_gib()

The model is the megatron-core mixed-precision recipe the local backend and NeMo use: bf16
weights, fp32 gradient buffers (grads are reduced in fp32), and the distributed optimiser's fp32
master copy plus Adam's two moments, sharded over the data-parallel ranks (including CP, which
megatron-core folds into the optimiser's sharding group). Everything is bytes per GPU on the
worst pipeline stage. The figures are estimates with named assumptions (docs/cluster-planning.md
compares them with layouts that are known to run); fragmentation, NCCL buffers and the CUDA
context are not modelled here but kept as headroom by the layout search (cluster_layout.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ba.model_shape import PRESETS, ModelShape, preset
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION

GIB = 1024**3


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
    return ModelShape.from_hf_config(cfg, name=str(name_or_path))


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # fp32 gradient buffer (megatron-core reduces gradients in fp32)
    optimizer_bytes: int = 12  # fp32 master weights + Adam m + Adam v, sharded over DP x CP
    act_bytes: int = 2  # bf16 activations
    logits_bytes: int = 2  # bf16 logits out of the output layer


PRECISION = Precision()


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_tokens: int  # tokens of one micro-batch of one model replica, before CP splits it
    recompute: bool = False  # full recomputation: keep each layer's input, redo the layer
    chunked_logprobs: bool = True  # megatron_ba.megatron.vocab_parallel's chunked path
    logprob_chunk: int = 1024  # its tokens per chunk
    sequence_parallel: bool = True  # with tp > 1: the norms' activations sharded over TP too


@dataclass(frozen=True)
class VLLMShare:
    """A colocated vLLM engine: it reserves `gpu_util` of the GPU while it generates; with
    `sleeps` (NeMo-RL's and verl's colocated mode) it frees that memory while the policy trains,
    and the trainer keeps only its weights on the GPU during generation (gradients and optimiser
    states offloaded), else everything of both stays."""

    gpu_util: float = VLLM_GPU_MEMORY_UTILIZATION  # the recipe's rollout.gpu_memory_utilization
    sleeps: bool = True  # the recipe's rollout.sleep


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

    def breakdown_gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in asdict(self).items() if k != "worst_stage"}

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


def stage_params(shape: ModelShape, pp: int, stage: int) -> int:
    """Parameters held by pipeline `stage`: its layers, the embedding on the first, the output
    layer (or, tied, its copy of the embedding) and the final norm on the last."""
    n = shape.num_layers // pp * shape.layer_params()
    if stage == 0:
        n += shape.embedding_params()
    if stage == pp - 1:
        n += shape.hidden_size + (
            shape.head_params() or (shape.embedding_params() if pp > 1 else 0)
        )
    return n


def estimate(
    shape: ModelShape,
    layout: Layout,
    *,
    gpu_mem_gib: float,
    vllm: VLLMShare | None = None,
    precision: Precision = PRECISION,
) -> MemoryEstimate:
    """The per-GPU estimate of the worst pipeline stage (the larger of its phases' peaks)."""
    if shape.num_layers % layout.pp:
        raise ValueError(f"pp={layout.pp} does not divide the {shape.num_layers} layers")
    best = None
    for stage in range(layout.pp):
        est = _estimate_stage(shape, layout, stage, gpu_mem_gib, vllm, precision)
        if best is None or est.peak > best.peak:
            best = est
    return best


def _estimate_stage(shape, layout, stage, gpu_mem_gib, vllm, prec) -> MemoryEstimate:
    t, p, c, d = layout.tp, layout.pp, layout.cp, layout.dp
    params = stage_params(shape, p, stage) / t  # TP shards every matrix (vocab-parallel too)
    weights = params * prec.param_bytes
    grads = params * prec.grad_bytes
    optimizer = params * prec.optimizer_bytes / (d * c)

    tokens = layout.micro_batch_tokens / c  # CP splits every sequence across c ranks
    layers = shape.num_layers // p
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
    activations = full_recompute if layout.recompute else no_recompute

    logits_naive = logits_chunked = 0.0
    if stage == p - 1:
        v_local = shape.vocab_size / t
        # naive (log_softmax of the fp32 logits through autograd): the bf16 logits plus 20 bytes
        # per logit of fp32 saved tensors and the gradient, as measured (docs/performance.md,
        # "Vocab-parallel log-prob": 5935 MiB extra at T 16,384 x V/TP 18,992).
        logits_naive = tokens * v_local * (prec.logits_bytes + 20)
        # chunked: the bf16 logits and their gradient, two fp32 chunk buffers of C x V/t (742 MiB
        # extra measured at C 1024 there: 594 MiB gradient + 2 x 1024 x 18,992 x 4 bytes).
        chunk = min(layout.logprob_chunk, tokens)
        logits_chunked = tokens * v_local * 2 * prec.logits_bytes + 2 * chunk * v_local * 4
    logits = logits_chunked if layout.chunked_logprobs else logits_naive

    gpu = gpu_mem_gib * GIB
    reserved = vllm.gpu_util * gpu if vllm is not None else 0.0
    # vLLM's engine shards the whole model over the same tp (every stage's weights: vLLM does not
    # pipeline here), and keeps what its reservation leaves for the KV cache.
    vllm_weights = shape.total_params() / t * prec.param_bytes
    kv_cache = max(0.0, reserved - vllm_weights) if vllm is not None else 0.0
    vllm_train = 0.0 if (vllm is None or vllm.sleeps) else reserved
    train_phase = weights + grads + optimizer + activations + logits + vllm_train
    if vllm is None:
        generate_phase = 0.0
    elif vllm.sleeps:
        generate_phase = weights + reserved
    else:
        generate_phase = weights + grads + optimizer + reserved
    return MemoryEstimate(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        activations_no_recompute=no_recompute,
        activations_full_recompute=full_recompute,
        logits=logits,
        logits_naive=logits_naive,
        logits_chunked=logits_chunked,
        vllm_train_phase=vllm_train,
        vllm_kv_cache=kv_cache,
        train_phase=train_phase,
        generate_phase=generate_phase,
        peak=max(train_phase, generate_phase),
        worst_stage=stage,
    )


def kv_cache_bytes_per_token(shape: ModelShape, tp: int, kv_bytes: int = 2) -> float:
    """vLLM's KV cache per token on one GPU of a TP-`tp` engine (keys and values, every layer)."""
    kv_heads_local = max(1, shape.num_query_groups // tp)  # vLLM replicates when tp > kv
    return 2 * shape.num_layers * kv_heads_local * shape.head_dim * kv_bytes
