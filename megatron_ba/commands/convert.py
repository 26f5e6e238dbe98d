"""`megatron-ba convert`: Hugging Face folder <-> megatron-core distributed checkpoint.

    megatron-ba convert HF_DIR CKPT_DIR                 # HF -> megatron-core (dist checkpoint)
    megatron-ba convert CKPT_DIR HF_OUT --to hf         # and back
    torchrun --nproc-per-node 2 -m megatron_ba.cli convert HF_DIR CKPT_DIR --tp 2

Convert once before a cluster run: the checkpoint is megatron-core's `torch_dist` format of the
model's sharded state dict, which loads under any TP x PP layout, whatever layout wrote it;
--tp / --pp only choose how this conversion itself is split (the world size must be tp * pp).
Qwen2 / Qwen2.5 / Qwen3 (the families of megatron_ba.conversion); details in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Hugging Face folder (--to megatron) or a checkpoint (--to hf)")
    p.add_argument("out", help="the folder to write (must be new or empty)")
    p.add_argument(
        "--to",
        choices=("megatron", "hf"),
        default="megatron",
        help="megatron: HF folder -> distributed checkpoint (default); hf: the reverse",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this conversion")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this conversion")


def _check_args(args: argparse.Namespace) -> None:
    from megatron_ba.conversion.dist_checkpoint import SPEC_FILE

    src = Path(args.src)
    if not src.is_dir():
        raise ValueError(f"src: {args.src!r} is not a folder")
    for name in ("tp", "pp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.to == "megatron" and (src / SPEC_FILE).is_file():
        raise ValueError(f"src: {args.src!r} is a megatron-ba checkpoint; did you mean --to hf?")
    if args.to == "megatron" and not (src / "config.json").is_file():
        raise ValueError(f"src: {args.src!r} has no config.json (not a Hugging Face folder)")
    if args.to == "hf" and not (src / SPEC_FILE).is_file():
        raise ValueError(f"src: {args.src!r} has no {SPEC_FILE} (not a megatron-ba checkpoint)")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"out: {args.out!r} is not empty")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    from megatron_ba.conversion import dist_checkpoint as dc
    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.megatron import model as mm
    from megatron_ba.train.distributed import setup, teardown

    t0 = time.perf_counter()
    spec = spec_from_hf_dir(args.src) if args.to == "megatron" else dc.read_spec(args.src)
    spec.check_layout(args.tp, args.pp)
    ctx = setup(tp=args.tp, pp=args.pp, cp=1, seed=0)
    try:
        # Every weight is overwritten by the load: skip megatron-core's random initialisation.
        config = mm.transformer_config(spec, perform_initialization=False)
        chunks = mm.build_model_chunks(spec, ddp=False, config=config)
        if args.to == "megatron":
            load_hf_into_chunks(chunks, args.src, spec)
            dc.save_dist_checkpoint(chunks, spec, args.out, source_dir=args.src)
        else:
            dc.load_dist_checkpoint(chunks, args.src)
            meta = Path(args.src) / dc.HF_META
            source = meta if (meta / "config.json").is_file() else None
            export_chunks_to_hf(chunks, spec, args.out, source_dir=source)
        ctx.barrier()
        if ctx.is_main:
            n = spec.num_parameters()
            print(
                f"convert: {spec.family} model, {n / 1e6:.1f}M parameters, "
                f"{args.src} -> {args.out} ({args.to}) in {time.perf_counter() - t0:.1f} s"
            )
    finally:
        teardown()
    return 0
