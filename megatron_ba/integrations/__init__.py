"""Adapters that run megatron-ba's GRPO core inside other training frameworks."""
