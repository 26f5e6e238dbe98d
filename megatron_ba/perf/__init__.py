"""Speed and memory measurements (`megatron-ba perf NAME`); results in docs/performance.md.
("Benchmarks" are the evaluation sets: megatron_ba.data.benchmarks.)"""
