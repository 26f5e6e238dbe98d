"""`megatron-ba tiny-model OUT`: a tiny random Hugging Face checkpoint with its tokenizer, offline.

    megatron-ba tiny-model runs/tiny-qwen3     # Qwen3: what recipes/tiny-hf-cpu.yaml loads
    megatron-ba tiny-model runs/tiny-qwen2 --family qwen2   # Qwen2: QKV bias, tied
    megatron-ba tiny-model runs/tiny-moe --family qwen3_moe  # Qwen3-MoE: 8 experts, top-2
    megatron-ba tiny-model runs/q35 --family qwen3_5     # Qwen3.5: 3 DeltaNet, 1 gated attention
    megatron-ba tiny-model runs/q35-moe --family qwen3_5_moe  # + 8 experts and a shared one

Saved by `transformers` itself (save_pretrained): config.json, model.safetensors, a byte-level BPE
tokenizer with a ChatML chat template, generation_config.json. Nothing is downloaded; the
weights are a function of --seed. An existing folder with a config.json is left as it is.
Qwen3.5 is written in its text layout (Qwen3_5ForCausalLM; megatron_ba.testing.tiny_hf builds
the published multimodal layout too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_ba.testing.tiny_hf import (
    build_tiny_qwen2,
    build_tiny_qwen3,
    build_tiny_qwen3_5,
    build_tiny_qwen3_5_moe,
    build_tiny_qwen3_moe,
)

BUILDERS = {
    "qwen3": build_tiny_qwen3,
    "qwen2": build_tiny_qwen2,
    "qwen3_moe": build_tiny_qwen3_moe,
    "qwen3_5": build_tiny_qwen3_5,
    "qwen3_5_moe": build_tiny_qwen3_5_moe,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the folder to write")
    p.add_argument("--family", choices=list(BUILDERS), default="qwen3")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if (args.out / "config.json").is_file():
        print(f"tiny-model: {args.out} already holds a model; kept")
        return 0
    build = BUILDERS[args.family]
    tmp = args.out.with_name(args.out.name + ".tmp")
    build(tmp, seed=args.seed)
    tmp.rename(args.out)  # whole or absent
    print(f"tiny-model: wrote a {args.family} checkpoint to {args.out}")
    return 0
