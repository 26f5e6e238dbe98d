"""Benchmarks (`megatron-ba bench NAME`); results are recorded in docs/performance.md."""
