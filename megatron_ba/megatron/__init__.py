"""megatron-core integration: thin adapters over the core (imports megatron-core lazily).

- model: a Qwen2-shaped GPTModel builder, full-shape weight loading and gathering.
- vocab_parallel: token log-probs and entropy from vocab-sharded (TP) logits, chunked path.
- grpo_step: the GRPO train step, forward-only log-probs and the optimiser step on the schedules.
- cpu_compat: CPU/gloo shims for megatron-core (imported only by CPU runs).
"""
