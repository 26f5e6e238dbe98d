"""The generation phase of a colocated engine (vLLM or SGLang), term by term, per GPU.

    share = EngineShare(0.6, engine="vllm")               # the engine's key and how it runs
    terms = generation_terms(shape, layout, stage, share, gpu_bytes=79.11 * GIB)
    terms.pool, terms.refit_bucket, terms.refit_full_param, engine_process_bytes(share)

What each engine's memory key covers, read off the engines' own code:

* vLLM's `gpu_memory_utilization` U: the engine requests U x the GPU's total memory and gives
  its KV cache what is left of that after the weights, the profiled activation peak (its
  dummy sampler run included) and what its process allocated since its start-up snapshot
  (vllm/v1/worker/gpu_worker.py `determine_available_memory`, vllm/utils/mem_utils.py
  `memory_profiling`, vLLM 0.32.0, the version requirements/gpu.txt pins). CUDA graphs are
  counted inside U since vLLM 0.21 (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`, default 1 in
  vllm/envs.py) and outside it before; this project's engine captures none (`enforce_eager=True`,
  megatron_ba/generation/vllm_engine.py). The process's CUDA context and NCCL communicators are
  made before that snapshot (`init_device`: "Initialize the distributed environment BEFORE
  taking memory snapshot"), so they are outside U: ENGINE_PROCESS_GIB below.
* what vLLM's accounting leaves outside U: its CUDA graphs where they are captured after the KV
  cache is sized (before the profiler's estimate, as in vLLM 0.20.0, the version NeMo-RL
  v0.7.0's uv.lock pins, with NeMo-RL's `enforce_eager: False`, examples/configs/
  grpo_math_1B.yaml line 349). vLLM states no size for them, only measures it when it captures
  ("Graph capturing finished ..., took X GiB"), so the planner counts none: a named gap
  (docs/cluster-planning.md), not a constant.
* SGLang's `mem_fraction_static` F: F x the GPU holds the weights and the KV cache pool
  (python/sglang/srt/server_args.py, `--mem-fraction-static`: "The fraction of the memory used
  for static allocation (model weights and KV cache memory pool)"), so its activations and CUDA
  graph buffers come out of the rest. How large they are depends on its chunked-prefill size and
  captured batch sizes, which no source gives per model: the planner leaves them out
  (docs/cluster-planning.md, "optimistic").

What the pool holds per sequence, for the verdict's "one sequence fits" and the JSON's
engine_sequences (sequence_cache_bytes): each full-attention layer's keys and values of every
token (kv_cache_bytes_per_token x the sequence's tokens); each Gated DeltaNet layer of a Qwen3.5
model instead a fixed state per sequence, whatever its length, as vLLM allocates it for the
"mamba"-style layers (vllm/model_executor/layers/mamba/mamba_utils.py,
MambaStateShapeCalculator.gated_delta_net_state_shape, vLLM 0.32.0): the recurrent state of
value heads / TP x value head dim x key head dim, in the config's mamba_ssm_dtype (the Qwen3.5
configs' float32: vllm/model_executor/models/config.py applies it to the cache's
mamba_ssm_cache_dtype, MambaStateDtypeCalculator._mamba_state_dtype), and the convolution's state
of (2 Kd + Vd) / TP x (kernel - 1) in the model dtype (bf16). Not modelled: vLLM pads the
attention layers' block size until one block's page is as large as a Gated DeltaNet state's
page (the hybrid models' unified page size), so a sequence's last, partly filled blocks round up;
speculative decoding's extra conv columns (num_spec) and the per-prefix states of prefix caching
for these layers.

Terms the engine adds beyond its pool, each with its source:

* ENGINE_PROCESS_GIB: an engine in a process of its own (this project's, NeMo-RL's, SGLang's)
  keeps a CUDA context, its communicators and what its sleep mode does not release, in both
  phases (it sleeps while the policy trains, it is not gone). Read off the same two
  out-of-memory messages as planning.memory_settings.NON_TORCH_GIB, each of which names the
  other process on the GPU: slime's colocated SGLang engine, asleep while its trainer went out
  of memory:
  https://github.com/THUDM/slime/issues/1767 (H100): "Process 520735 has 3.17 GiB memory in use"
  beside the trainer's 48.84; https://github.com/THUDM/slime/issues/1951 (H200): "Process 22249
  has 3.24 GiB memory in use" beside the trainer's 88.83. The mean, 3.205 GiB. An engine in the
  trainer's process (verl's sync mode: vLLM with `distributed_executor_backend=
  "external_launcher"`, verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py) shares the
  trainer's context: nothing added.
* the refit: the trainer's weights gathered to full tensors and converted into the engine's
  layout while both are on the GPU. This project's refit (megatron_ba/generation/refit.py:
  "At no time does a rank hold more than its shards, one full parameter and one bucket") holds
  one bucket of `rollout.refit_bucket_mb` MiB (weight_buckets.py; default 256) and one full
  parameter in the engine's dtype (bf16) on the engine rank; verl's megatron refit streams one
  full tensor at a time (no bucket). This project wakes the whole engine first (`wake_up()` in
  megatron_ba/train/rollouts.py `sync`), so the refit lies beside the KV cache; verl and
  NeMo-RL wake its weights, refit, and only then allocate the KV cache (`refit_before_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.recipe import VLLM_GPU_MEMORY_UTILIZATION
from megatron_ba.recipe.schema import RolloutSection

GIB = 1024**3
MIB = 1024**2

ENGINES = ("vllm", "sglang")
# each engine's name in messages and the flag of `megatron-ba layout` that sets its key
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
ENGINE_FLAGS = {"vllm": "--vllm-gpu-util", "sglang": "--sglang-mem-fraction"}

ENGINE_PROCESS_GIB = (3.17 + 3.24) / 2  # module docstring: the sleeping engine's process
REFIT_BUCKET_MB = RolloutSection.refit_bucket_mb  # this project's rollout.refit_bucket_mb
ENGINE_BYTES = 2  # the engine's bf16 weights, and the refit's tensors cast to them
# A Gated DeltaNet's per-sequence state in vLLM (module docstring): the recurrent state in the
# config's mamba_ssm_dtype (float32 in the Qwen3.5 configs), the convolution state in the model
# dtype (bf16).
GDN_STATE_BYTES = 4
GDN_CONV_BYTES = 2


@dataclass(frozen=True)
class EngineShare:
    """A colocated generation engine: its memory key (`gpu_util`: vLLM's gpu_memory_utilization
    or SGLang's mem_fraction_static), whether it sleeps while the policy trains (NeMo-RL's,
    verl's and this project's colocated mode), its tensor parallelism, whether it runs in the
    trainer's process, and the refit's bucket and order (module docstring). What the trainer
    keeps beside it is MemorySettings.offload's (trainer_kept: with "auto" its weights beside a
    sleeping engine, this project's; NeMo-RL's colocated refit moves even the weights off, its
    "states"). A bad value raises ValueError naming the flag of `megatron-ba layout`."""

    gpu_util: float = VLLM_GPU_MEMORY_UTILIZATION  # the recipe's rollout.gpu_memory_utilization
    sleeps: bool = True  # the recipe's rollout.sleep
    tp: int | None = None  # the engine's tensor parallelism (None: the trainer's tp)
    engine: str = "vllm"
    in_process: bool = False  # the engine shares the trainer's process (no ENGINE_PROCESS_GIB)
    refit_bucket_mb: float = REFIT_BUCKET_MB  # 0: one tensor at a time, no bucket
    refit_before_kv: bool = False  # the refit runs before the KV cache is allocated

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine: one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0 < self.gpu_util < 1:
            flag = ENGINE_FLAGS[self.engine]
            raise ValueError(f"{flag}: must be in (0, 1), got {self.gpu_util}")
        if not self.refit_bucket_mb >= 0:
            raise ValueError(f"--refit-bucket-mb: must be >= 0, got {self.refit_bucket_mb}")

    @property
    def name(self) -> str:
        return ENGINE_NAMES[self.engine]


VLLMShare = EngineShare  # the name the planner's callers have used


@dataclass(frozen=True)
class GenerationTerms:
    """Bytes per GPU a colocated engine adds to one pipeline stage's GPU (module docstring)."""

    pool: float  # the engine's key x the GPU: what it holds while it generates
    engine_weights: float  # its weights, inside the pool (the whole model over its TP)
    kv_cache: float  # what the pool leaves for the KV cache after the weights
    refit_bucket: float  # the refit's bucket (the engine rank's; stage 0)
    refit_full_param: float  # the largest of this stage's tensors gathered to full size
    kv_per_sequence: float = 0.0  # one sequence's keys and values (full-attention layers)
    linear_state_per_sequence: float = 0.0  # its Gated DeltaNet layers' recurrent states
    conv_state_per_sequence: float = 0.0  # their convolution states
    sequences: int = 0  # sequences of that length the KV cache holds at once


def engine_tp(share: EngineShare, layout: ParallelLayout) -> int:
    return share.tp or layout.tp


def engine_weights_bytes(shape: ModelShape, tp: int) -> float:
    """The engine's weights on one of its GPUs: every stage's (the engine does not pipeline)
    over its tensor parallelism."""
    return shape.total_params() / tp * ENGINE_BYTES


def largest_full_tensor(shape: ModelShape, layout: ParallelLayout, stage: int) -> int:
    """Elements of the largest tensor stage `stage` gathers to full size for the refit: the
    embedding (first stage), the untied output layer (last stage; a tied copy is not sent), and
    of its layers the fused QKV, the attention output, the MLP's fused gate/up (megatron's
    linear_fc1), the down projection, and for a mixture of experts one expert's (gathered one at
    a time), the shared expert's and the router's."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    gate = q if shape.attention_output_gate else 0  # the fused QKV also produces the gate
    sizes = [(q + gate + 2 * kv) * h, q * h]
    if shape.has_linear_attention:  # a Gated DeltaNet's input and output projections
        nv = shape.linear_num_value_heads
        kd = shape.linear_num_key_heads * shape.linear_key_head_dim
        vd = nv * shape.linear_value_head_dim
        sizes += [(2 * kd + 2 * vd + 2 * nv) * h, vd * h]
    if shape.is_moe:
        fe, fs = shape.moe_ffn_hidden_size, shape.shared_expert_ffn_hidden_size
        sizes += [2 * fe * h, shape.num_experts * h, 2 * fs * h]
        if any(not shape.is_moe_layer(i) for i in range(shape.num_layers)):
            sizes.append(2 * shape.ffn_hidden_size * h)
    else:
        sizes.append(2 * shape.ffn_hidden_size * h)
    if stage == 0:
        sizes.append(shape.embedding_params())
    if stage == layout.pp - 1:
        sizes.append(shape.head_params())
    return max(sizes)


def generation_terms(
    shape: ModelShape,
    layout: ParallelLayout,
    stage: int,
    share: EngineShare,
    gpu_bytes: float,
    seq_len: int | None = None,
) -> GenerationTerms:
    """The engine's terms on stage `stage`'s GPUs (the refit's bucket on the engine rank, stage
    0; one full tensor on every stage's TP rank 0, which sends it); with `seq_len`, what one
    sequence of that many tokens takes in the pool and how many the KV cache holds at once."""
    tp = engine_tp(share, layout)
    pool = share.gpu_util * gpu_bytes
    weights = engine_weights_bytes(shape, tp)
    kv_cache = max(0.0, pool - weights)
    recurrent, conv = linear_state_bytes_per_sequence(shape, tp)
    per_token = kv_cache_bytes_per_token(shape, tp)
    kv_seq = per_token * seq_len if seq_len else 0.0
    per_seq = kv_seq + recurrent + conv
    return GenerationTerms(
        pool=pool,
        engine_weights=weights,
        kv_cache=kv_cache,
        refit_bucket=share.refit_bucket_mb * MIB if stage == 0 else 0.0,
        refit_full_param=largest_full_tensor(shape, layout, stage) * ENGINE_BYTES,
        kv_per_sequence=kv_seq,
        linear_state_per_sequence=recurrent,
        conv_state_per_sequence=conv,
        sequences=int(kv_cache // per_seq) if seq_len and per_seq else 0,
    )


def generation_phase(
    terms: GenerationTerms, share: EngineShare, kept: float, weights: float, reference: float
) -> tuple[float, float, str]:
    """(the generation phase's peak, the refit's instant, which of the pool or the engine's
    weights alone is in the engine's memory at that peak: "pool" or "weights").

    `kept`: what the trainer keeps on the GPU while the engine generates; `weights`: the
    trainer's own weights, which the refit reads (a trainer that offloads them brings them back
    to send them); `reference`: a reference policy's weights on the GPU."""
    refit = terms.refit_bucket + terms.refit_full_param
    decode = kept + reference + terms.pool
    if share.refit_before_kv:  # only the engine's weights are awake while it refits
        instant = max(kept, weights) + reference + terms.engine_weights + refit
        if instant > decode:
            return instant, instant, "weights"
        return decode, instant, "pool"
    instant = max(kept, weights) + reference + terms.pool + refit
    return instant, instant, "pool"


def engine_fields(
    shape: ModelShape,
    layout: ParallelLayout,
    offload: str,
    stage: int,
    gpu_bytes: float,
    vllm: EngineShare | None,
    states: tuple[float, float, float, float],
    seq_len: int | None = None,
) -> dict:
    """planning.memory.MemoryEstimate's generation fields on stage `stage`, and "held" (the
    engine's own memory on the GPU at the generation phase's peak: its pool, or its weights
    alone at a refit before the KV cache), for the trainer's `states` = (weights, gradients,
    optimiser, reference) there and MemorySettings.offload `offload`; `seq_len`: the sequence
    the per-sequence terms describe (None: those of the KV cache are 0)."""
    weights, reference = states[0], states[3]
    out = dict(engine_pool=0.0, engine_weights=0.0, refit_bucket=0.0, refit_full_param=0.0,
               vllm_train_phase=0.0, vllm_kv_cache=0.0, generate_phase=0.0, refit_phase=0.0,
               engine_kv_per_sequence=0.0, engine_linear_state_per_sequence=0.0,
               engine_conv_state_per_sequence=0.0, engine_sequences=0,
               held=0.0)  # fmt: skip
    if vllm is None:
        return out
    terms = generation_terms(shape, layout, stage, vllm, gpu_bytes, seq_len)
    kept = trainer_kept(offload, vllm, states)
    generate, refit, held = generation_phase(terms, vllm, kept, weights, reference)
    return out | dict(
        engine_pool=terms.pool,
        engine_weights=terms.engine_weights,
        refit_bucket=terms.refit_bucket,
        refit_full_param=terms.refit_full_param,
        vllm_train_phase=0.0 if vllm.sleeps else terms.pool,  # an engine awake keeps its pool
        vllm_kv_cache=terms.kv_cache,
        generate_phase=generate,
        refit_phase=refit,
        engine_kv_per_sequence=terms.kv_per_sequence,
        engine_linear_state_per_sequence=terms.linear_state_per_sequence,
        engine_conv_state_per_sequence=terms.conv_state_per_sequence,
        engine_sequences=terms.sequences,
        held=terms.pool if held == "pool" else terms.engine_weights,
    )


def trainer_kept(offload: str, share: EngineShare | None, states) -> float:
    """What the trainer keeps on the GPU between its update and its next training phase, for
    MemorySettings.offload `offload` and `states` = (weights, gradients, optimiser, reference):
    "none" all three, "states" nothing (verl's offload; NeMo-RL's colocated refit:
    `offload_before_refit` moves the gradients and optimiser off, `offload_after_refit` then the
    weights too, nemo_rl/models/policy/workers/megatron_policy_worker.py v0.7.0 lines 1486-1592,
    called by nemo_rl/algorithms/grpo.py refit_policy_generation lines 1875-1966 before the KV
    cache is woken), "auto" the weights beside a sleeping engine, all three beside one awake.
    Without a colocated engine there is no refit to offload for: the weights and the optimiser,
    as NeMo-RL's log-prob pass keeps them (planning/logprob_memory.py), whatever `offload`."""
    weights, grads, optimizer, _ = states
    if share is None:
        return weights + optimizer
    if offload == "states":
        return 0.0
    if offload == "none":
        return weights + grads + optimizer
    return weights if share.sleeps else weights + grads + optimizer


def engine_process_bytes(share: EngineShare | None) -> float:
    """What a colocated engine in a process of its own holds outside its pool, in both phases
    (ENGINE_PROCESS_GIB); 0 without an engine or with one in the trainer's process."""
    if share is None or share.in_process:
        return 0.0
    return ENGINE_PROCESS_GIB * GIB


def engine_json(share: EngineShare | None) -> dict:
    """The JSON's keys of the colocated engine the estimate assumes (all None without one)."""
    if share is None:
        return {k: None for k in ("engine", "engine_mem_fraction", "engine_in_process",
                                  "refit_bucket_mb", "refit_before_kv")}  # fmt: skip
    return {
        "engine": share.engine,
        "engine_mem_fraction": share.gpu_util,
        "engine_in_process": share.in_process,
        "refit_bucket_mb": share.refit_bucket_mb,
        "refit_before_kv": share.refit_before_kv,
    }


def kv_cache_bytes_per_token(shape: ModelShape, tp: int, kv_bytes: int = 2) -> float:
    """An engine's KV cache per token on one GPU of a TP-`tp` engine (keys and values of every
    full-attention layer; a Gated DeltaNet layer keeps none: linear_state_bytes_per_sequence)."""
    kv_heads_local = max(1, shape.num_query_groups // tp)  # engines replicate when tp > kv
    layers = sum(not shape.is_linear_attention_layer(i) for i in range(shape.num_layers))
    return 2 * layers * kv_heads_local * shape.head_dim * kv_bytes


def linear_state_bytes_per_sequence(shape: ModelShape, tp: int) -> tuple[float, float]:
    """(recurrent, convolution) state bytes one sequence holds on one GPU of a TP-`tp` engine
    over all its Gated DeltaNet layers, whatever its length (module docstring: vLLM's
    gated_delta_net_state_shape); (0, 0) without such layers."""
    layers = sum(shape.is_linear_attention_layer(i) for i in range(shape.num_layers))
    if not layers:
        return 0.0, 0.0
    nv, dk, dv = (shape.linear_num_value_heads, shape.linear_key_head_dim,
                  shape.linear_value_head_dim)  # fmt: skip
    conv_dim = 2 * shape.linear_num_key_heads * dk + nv * dv
    recurrent = -(-nv // tp) * dv * dk * GDN_STATE_BYTES
    conv = -(-conv_dim // tp) * (shape.linear_conv_kernel_dim - 1) * GDN_CONV_BYTES
    return float(layers * recurrent), float(layers * conv)


def sequence_cache_bytes(shape: ModelShape, tp: int, seq_len: int) -> float:
    """What one sequence of `seq_len` tokens takes in a TP-`tp` engine's KV cache on one GPU:
    the full-attention layers' keys and values of every token and the Gated DeltaNet layers'
    fixed states."""
    return kv_cache_bytes_per_token(shape, tp) * seq_len + sum(
        linear_state_bytes_per_sequence(shape, tp)
    )
