"""megatron-core integration: vocab-parallel log-probs, loss functions and layout checks."""
