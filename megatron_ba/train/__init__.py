"""The `local` training backend: GRPO on megatron-core with vLLM rollouts, on one machine."""
