"""What the memory estimate takes besides the model and the layout (MemorySettings: the
micro-batch, recomputation, the log-prob path, the optimiser's placement, offload, the schedule)
and what it gives (MemoryEstimate, term by term), with the constants both use: the precision
recipe's bytes, the gradient buffer's dtype, and the overheads read off two out-of-memory
messages. planning.memory computes the estimate (its docstring: the model of memory)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 2  # bf16 weights
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
# Bytes per parameter of the Adam optimiser's states on the GPU (sharded over DP x CP by the
# distributed optimiser), by megatron-core's OptimizerConfig (optimizer/optimizer_config.py,
# distrib_optimizer.py, optimizer/__init__.py; 0.16.1):
# * "fp32": the default: an fp32 main copy of each bf16 parameter and fp32 exp_avg, exp_avg_sq;
# * "precision-aware": use_precision_aware_optimizer with fp32 main params and moments: TE's
#   FusedAdam keeps the master weights, and with store_param_remainders (the default from TE
#   2.1 with bf16) only each fp32 master's low 16 bits beside the bf16 parameter, an int16
#   state: 2 + 4 + 4 (NeMo-RL's megatron default turns the optimiser on);
# * "bf16": precision-aware with bf16 exp_avg_dtype and exp_avg_sq_dtype (and the master as
#   remainders or as main_params_dtype bf16, 2 bytes either way): 2 + 2 + 2.
OPTIMIZER_STATE_BYTES = {"fp32": 12, "precision-aware": 10, "bf16": 6}
RECOMPUTE = ("none", "selective", "full")
LOGPROBS = ("chunked", "megatron", "fp32", "naive", "te", "te-fp32-grad")
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
    # logits), "te" (Transformer Engine's fused cross entropy up to 2.17: the gradient written
    # into the bf16 logits), "te-fp32-grad" (from 2.18: the gradient kept in fp32);
    # chunked_logprobs=False means "naive".
    logprobs: str = "chunked"
    grad_reduce: str = "fp32"  # the gradient buffer's dtype (GRAD_BYTES): "fp32" or "bf16"
    optimizer_states: str = "fp32"  # the Adam states' bytes (OPTIMIZER_STATE_BYTES)
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
        if self.optimizer_states not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"--optimizer-states: one of {', '.join(OPTIMIZER_STATE_BYTES)}, got "
                f"{self.optimizer_states!r}"
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
