"""megatron-core integration: thin adapters over the core (imports megatron-core lazily).

- model: a Qwen2-shaped GPTModel builder (from a model_shape.ModelShape) and its initial weights.
- startup: the world, megatron-core's model-parallel groups, the CPU shims and RNG in one call.
- vocab_parallel: token log-probs and entropy from vocab-sharded (TP) logits, chunked path.
- grpo_step: the GRPO train step and forward-only log-probs on the schedules; loss_scale: the
  factor that cancels the schedules' scaling; batching, packing, thd: micro-batches.
- cpu_optimizer, optimizer_choice: the CPU optimiser, and which optimiser a run gets.
- cpu_compat: CPU/gloo shims for megatron-core (imported only by CPU runs).
"""
