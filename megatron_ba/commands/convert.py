"""`megatron-ba convert`: Hugging Face folder <-> megatron-core distributed checkpoint.

    megatron-ba convert HF_DIR CKPT_DIR                 # HF -> megatron-core (dist checkpoint)
    megatron-ba convert CKPT_DIR HF_OUT --to hf         # and back
    megatron-ba convert RUN/checkpoints/step-000020 HF_OUT --to hf   # a training checkpoint
    megatron-ba convert --nproc-per-node 2 HF_DIR CKPT_DIR --tp 2    # two processes for --tp 2

Convert once before a cluster run: the checkpoint is megatron-core's `torch_dist` format of the
model's sharded state dict, which loads under any TP x PP layout, whatever layout wrote it;
--tp / --pp only choose how this conversion itself is split (the world size must be tp * pp).
A training checkpoint's step folder (train/checkpoint.py) is read through its `dist/` folder:
the policy's weights (its optimiser state is not read).
Qwen2 / Qwen2.5 / Qwen3 (the families of megatron_ba.conversion); details in docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from megatron_ba.errors import UserError
from megatron_ba.parallel.local_launch import add_nproc_argument


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
    add_nproc_argument(p)


def _model_source(args: argparse.Namespace) -> Path:
    """The folder the weights are read from: `src`, or a training checkpoint's `dist/`."""
    # torch: imported on use, so that --help imports none
    from megatron_ba.train.checkpoint import DIST, is_training_checkpoint

    src = Path(args.src)
    if is_training_checkpoint(src):
        if args.to != "hf":
            raise UserError(f"src: {args.src!r} is a training checkpoint; did you mean --to hf?")
        return src / DIST
    return src


def _check_args(args: argparse.Namespace) -> None:
    # torch: imported on use, so that --help imports none
    from megatron_ba.conversion.dist_checkpoint import SPEC_FILE

    if not Path(args.src).is_dir():
        raise UserError(f"src: {args.src!r} is not a folder")
    src = _model_source(args)
    for name in ("tp", "pp"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.to == "megatron" and (src / SPEC_FILE).is_file():
        raise UserError(f"src: {args.src!r} is a megatron-ba checkpoint; did you mean --to hf?")
    if args.to == "megatron" and not (src / "config.json").is_file():
        raise UserError(f"src: {args.src!r} has no config.json (not a Hugging Face folder)")
    if args.to == "hf" and not (src / SPEC_FILE).is_file():
        raise UserError(f"src: {args.src!r} has no {SPEC_FILE} (not a megatron-ba checkpoint)")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"out: {args.out!r} is not empty")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    # torch: imported on use, so that --help imports none
    from megatron_ba.conversion import dist_checkpoint as dc
    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.conversion.hf_config import dtype as config_dtype
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout

    t0 = time.perf_counter()
    src = _model_source(args)
    spec = spec_from_hf_dir(src) if args.to == "megatron" else dc.read_spec(src)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=None)
    try:
        layout.check_model(spec)
    except LayoutError as e:
        raise UserError(f"{e.renamed(FLAGS)} ({args.src})") from None
    ctx = setup(layout, seed=0)
    try:
        # Every weight is overwritten by the load, but megatron-core's initialisation is kept:
        # it is what marks each tensor-parallel weight with its partition dim, which the load
        # needs to shard (without it `--tp 2` fails on the embedding's shape).
        config = mm.transformer_config(spec)
        chunks = mm.build_model_chunks(spec, ddp=False, config=config)
        if args.to == "megatron":
            load_hf_into_chunks(chunks, src, spec)
            dc.save_dist_checkpoint(chunks, spec, args.out, source_dir=src)
        else:
            dc.load_dist_checkpoint(chunks, src)
            meta = src / dc.HF_META
            source = meta if (meta / "config.json").is_file() else None
            # The files in the source's dtype (a run trains a bf16 model in fp32), as the
            # trainer's own RUN_DIR/hf export; the spec's dtype without a source config.
            dtype = config_dtype(json.loads((meta / "config.json").read_text())) if source else None
            export_chunks_to_hf(chunks, spec, args.out, source_dir=source, dtype=dtype)
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
