"""The log-prob pass: a forward-only pass over a log-prob micro-batch, its own phase of a step.

    tokens = logprob_tokens(4, seq_len=4096)                 # 16,384: NeMo-RL's logprob_mb_tokens
    logprob_phase_bytes(shape, layout, step, stage, resident, per_layer)

A GRPO step computes the old policy's (and a reference policy's) log-probs of every generated
token before it trains, in micro-batches of their own: NeMo-RL's `policy.logprob_batch_size`
sequences (nemo_rl/models/policy/workers/megatron_policy_worker.py `get_logprobs`, v0.7.0
lines 877-971; examples/configs/grpo_math_1B.yaml line 110: `logprob_batch_size:
${policy.train_micro_batch_size}` by default; with sequence packing line 272: `logprob_mb_tokens:
${mul:${policy.max_total_sequence_length}, ${policy.logprob_batch_size}}`). A log-prob
micro-batch larger than the training one makes this pass, not training, the step's peak on the
last pipeline stage: it holds the whole vocabulary's logits of all its tokens at once.

What is on the GPU in the pass, each from NeMo-RL v0.7.0's megatron policy:

* the trainer's states: `prepare_for_lp_inference` (megatron_policy_worker.py lines 1411-1431)
  moves the weights back to the GPU and the gradient buffers off it; the optimiser leaves only
  with `offload_optimizer_for_logprob` (default false, grpo_math_1B.yaml line 114), so it stays
  where the previous phase left it: off the GPU after a colocated engine's refit
  (`offload_after_refit` moved everything off), on it otherwise. The planner's rule: what the
  trainer keeps beside the engine (generation_memory.trainer_kept), at least its weights; without
  an engine the weights and the optimiser (none of them with offload "states");
* one layer's activations (forward only, under no_grad: megatron-core's forward_only schedule
  frees each layer's tensors when the next layer runs), at the log-prob micro-batch's tokens;
* the log-prob path's forward over the logits of every token (LOGPROB_FORWARD_BYTES).
"""

from __future__ import annotations

from megatron_ba.planning.generation_memory import engine_fields, trainer_kept

# Bytes per logit (per token x vocabulary entry on a GPU) the log-prob paths hold at their
# forward-only peak (no tensor saved for a backward), by MemorySettings.logprobs:
# * "fp32": NeMo-RL's DistributedLogprob with inference_only=True (nemo_rl/distributed/
#   model_utils.py v0.7.0 lines 127-160): the fp32 logits the model returns (megatron's output
#   layer casts them unless defer_fp32_logits; the bf16 ones are freed by the cast),
#   `_compute_distributed_log_softmax`'s max-shifted copy and its exp, then the log-softmax and
#   `log_probs.exp()`, computed whether or not it is saved: three fp32 tensors, 12 bytes;
# * "megatron": megatron-core's vocab_parallel_cross_entropy forward: the bf16 logits and their
#   fp32 exp (its softmax), 2 + 4;
# * "naive": log_softmax of the fp32 logits: the bf16 logits, their fp32 cast and its
#   log-softmax, 2 + 4 + 4;
# * "chunked": the bf16 logits (2), and LOGPROB_CHUNK_BUFFERS fp32 buffers of one chunk
#   (logprob_phase_bytes);
# * "te": Transformer Engine's fused cross entropy up to 2.17 computes in place in the bf16
#   logits, 2; "te-fp32-grad", from 2.18, writes the gradient to an fp32 tensor beside them
#   (forward only as well), 2 + 4.
LOGPROB_FORWARD_BYTES = {
    "fp32": 12, "megatron": 6, "naive": 10, "chunked": 2, "te": 2, "te-fp32-grad": 6,
}  # fmt: skip
LOGPROB_CHUNK_BUFFERS = 2  # the chunked path's two fp32 chunk buffers (planning/memory.py _logits)


def logprob_tokens(batch_size: int | None, seq_len: int) -> int | None:
    """Tokens of one log-prob micro-batch of `batch_size` sequences (NeMo-RL's
    logprob_mb_tokens: max_total_sequence_length x logprob_batch_size); None: no such pass."""
    return None if batch_size is None else batch_size * seq_len


def logprob_logits_bytes(shape, layout, step, stage: int) -> float:
    """The log-prob path's forward over one log-prob micro-batch on stage `stage` (the last
    stage holds the logits; LOGPROB_FORWARD_BYTES); 0 without a log-prob pass."""
    if step.logprob_tokens is None or stage != layout.pp - 1:
        return 0.0
    tokens = step.logprob_tokens / layout.cp  # CP splits each sequence, as in training
    v_local = shape.vocab_size / layout.tp
    mode = step.logprob_mode
    out = tokens * v_local * LOGPROB_FORWARD_BYTES[mode]
    if mode == "chunked":
        out += LOGPROB_CHUNK_BUFFERS * min(step.logprob_chunk, tokens) * v_local * 4
    return out


def logprob_phase_bytes(
    shape, layout, step, stage: int, resident: float, per_layer
) -> tuple[float, float]:
    """(the log-prob pass's peak on stage `stage`, its logits' share of it): `resident` (the
    trainer's states on the GPU then, and a reference policy's weights), one layer's activations
    at the log-prob micro-batch's tokens on this GPU (`per_layer(tokens per GPU)`: planning.
    memory's per-layer activations) and the logits (logprob_logits_bytes). (0, 0) without a
    log-prob pass (step.logprob_tokens None)."""
    if step.logprob_tokens is None:
        return 0.0, 0.0
    logits = logprob_logits_bytes(shape, layout, step, stage)
    layer = per_layer(step.logprob_tokens / layout.cp)
    return resident + layer + logits, logits


def step_phases(shape, layout, step, stage, gpu_bytes, vllm, parts, per_layer, seq_len=None):
    """The three phases' peaks on one stage (training, generation by a colocated engine, the
    log-prob pass) and the engine's fields (generation_memory.engine_fields, "gen", its
    per-sequence terms for `seq_len` tokens): `parts` = (weights, gradients, optimiser,
    activations, logits, reference) of the training phase; `per_layer`: tokens per GPU -> one
    layer's activations. The peak's phase is the largest, training on a tie."""
    weights, grads, optimizer, activations, logits, reference = parts
    states = (weights, grads, optimizer, reference)
    gen = engine_fields(shape, layout, step.offload, stage, gpu_bytes, vllm, states, seq_len)
    awake = gen["vllm_train_phase"]  # an engine that does not sleep keeps its pool
    train = weights + grads + optimizer + activations + logits + reference + awake
    # the log-prob pass keeps what the trainer keeps beside the engine, at least its weights
    resident = max(trainer_kept(step.offload, vllm, states), weights) + reference + awake
    lp, lp_logits = logprob_phase_bytes(shape, layout, step, stage, resident, per_layer)
    phases = {"train": train, "generate": gen["generate_phase"], "logprob": lp}
    peak_phase = max(phases, key=lambda k: (phases[k], k == "train"))
    return dict(gen=gen, train=train, lp=lp, lp_logits=lp_logits, peak_phase=peak_phase,
                peak=phases[peak_phase])  # fmt: skip
