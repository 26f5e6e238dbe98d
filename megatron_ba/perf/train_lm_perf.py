"""Train a random Qwen2-shaped megatron-core model on a synthetic LM task: loss, speed, MFU.

    megatron-ba perf train-lm --shape qwen2.5-0.5b --device cuda --dtype bf16 --steps 20 \
        --compare-dtype fp32 --compare-steps 6 --sequences 8 --seq-len 4096 --micro-batches 4
    megatron-ba perf train-lm --device cpu --dtype fp32 --compare-dtype fp32 --steps 6  # plumbing

The model is built as the trainer builds it (build_options: precision, layer spec, `--attention`
core; megatron-core's DDP; optimizer_choice.build_optimizer: megatron-core's distributed optimiser
on CUDA, ShardedAdamW on the CPU) and trained with megatron-core's schedule on a fixed batch:
each sequence repeats one random block of `--block` tokens drawn from the first `--data-vocab`
token ids, so a model can lower its loss first by the tokens' frequencies, then by copying. The
loss is the mean next-token negative log-likelihood (megatron_ba's chunked vocab-parallel
log-probs, fp32).

Two runs from the same weights: `--dtype` for `--steps` steps (the timed run), then
`--compare-dtype` for `--compare-steps` steps (the first run's starting weights, upcast to fp32,
are the second's; `--compare-lr` changes the second run's learning rate, the comparison's control).
Criteria, each in the JSON with its figures (exit status 1 when one fails):

* the loss falls: the last step's loss is below the first step's by at least `--min-drop` nats;
* the two precisions agree: |loss_a - loss_b| <= `--rel-tol` x |loss_b| at every compared step.

Speed: the median seconds of the timed run's steps after `--timing-warmup` (forward, backward,
optimiser step, synchronised), tokens per second, and MFU = model FLOPs per step / seconds / the
GPU's dense bf16 peak (megatron_ba.planning.flops states the formula and the peak's source).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace

import torch

from megatron_ba.megatron import model as mm
from megatron_ba.megatron.batching import (
    CPView,
    MicroBatches,
    label_aligned,
    model_inputs,
    run_schedule,
)
from megatron_ba.megatron.build_options import resolve_build_options
from megatron_ba.megatron.loss_scale import loss_scale
from megatron_ba.megatron.optimizer_choice import apply_lr_schedule, build_optimizer, ddp_overrides
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.parallel import full_shape
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.perf.shapes import add_shape_arguments, model_spec
from megatron_ba.planning import flops
from megatron_ba.recipe import OptimizerSection

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GIB = 2**30


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = p or argparse.ArgumentParser(prog="megatron-ba perf train-lm")
    add_shape_arguments(p)
    p.add_argument("--sequences", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--dtype", choices=DTYPES, default="bf16" if cuda else "fp32")
    p.add_argument("--steps", type=int, default=20, help="steps of the timed run")
    p.add_argument("--compare-dtype", choices=(*DTYPES, "none"), default="fp32")
    p.add_argument("--compare-steps", type=int, default=6, help="steps of the comparison run")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument(
        "--compare-lr", type=float, default=None, help="the comparison run's (default: --lr)"
    )
    p.add_argument("--warmup-steps", type=int, default=3, help="linear LR warm-up steps")
    p.add_argument("--block", type=int, default=64, help="tokens of each sequence's block")
    p.add_argument("--data-vocab", type=int, default=256, help="token ids the data uses")
    p.add_argument("--attention", choices=("auto", "sdpa", "unfused"), default="auto")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--logprob-chunk-size", type=int, default=1024)
    p.add_argument("--min-drop", type=float, default=1.0, help="nats the loss must fall")
    p.add_argument("--rel-tol", type=float, default=0.05, help="precision agreement tolerance")
    p.add_argument("--timing-warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="default: by GPU name")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def _check_args(args, device: torch.device) -> None:
    problems = []
    if args.sequences % args.micro_batches:
        problems.append(f"--micro-batches {args.micro_batches}: must divide --sequences")
    if not 1 <= args.compare_steps <= args.steps:
        problems.append(f"--compare-steps {args.compare_steps}: must be in [1, --steps]")
    if args.steps <= args.timing_warmup:
        problems.append(f"--steps {args.steps}: must exceed --timing-warmup")
    if args.block < 1 or args.data_vocab < 2:
        problems.append("--block must be >= 1 and --data-vocab >= 2")
    if device.type != "cuda" and "bf16" in (args.dtype, args.compare_dtype):
        problems.append(f"--dtype bf16: needs a CUDA device (megatron-core's optimiser), {device}")
    if problems:
        raise SystemExit("; ".join(problems))


def synthetic_tokens(args, vocab_size: int) -> torch.Tensor:
    """[sequences, seq_len]: each row one random block of --block ids < --data-vocab, repeated."""
    if args.data_vocab > vocab_size:
        raise SystemExit(f"--data-vocab {args.data_vocab}: exceeds the vocabulary ({vocab_size})")
    g = torch.Generator().manual_seed(args.seed)
    blocks = torch.randint(0, args.data_vocab, (args.sequences, args.block), generator=g)
    repeats = -(-args.seq_len // args.block)
    return blocks.repeat(1, repeats)[:, : args.seq_len]


def lm_microbatches(tokens: torch.Tensor, num_microbatches: int, view: CPView) -> list[dict]:
    """The schedule's micro-batches: model inputs, next-token targets, and the loss mask (every
    position but the last, which predicts nothing)."""
    data = []
    for rows in tokens.chunk(num_microbatches):
        ids, pos, attn = model_inputs(rows, view)
        mask = label_aligned(torch.ones_like(rows, dtype=torch.bool), False)
        data.append(
            {
                "input_ids": ids,
                "position_ids": pos,
                "attention_mask": attn,
                "targets": label_aligned(rows, 0),
                "mask": mask,
            }
        )
    return data


def lm_forward_backward(chunks, data: list[dict], seq_len: int, chunk_size: int | None) -> float:
    """One forward/backward of the mean token loss over `data` (equal micro-batches); the
    gradients finalised in DDP's buffers. Returns the step's loss."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    chunks[0].zero_grad_buffer()
    m = len(data)
    # Each micro-batch's mean is 1/M of the step's loss; the factor cancels the schedule's 1/M.
    factor = loss_scale(m, 1, 1, per_token_loss=bool(config.calculate_per_token_loss))
    one = torch.ones((), dtype=torch.int, device=data[0]["input_ids"].device)

    def loss_func(mb, output):
        logp = vocab_parallel_logprobs(output, mb["targets"], chunk_size=chunk_size)
        part = -(logp * mb["mask"]).sum() / mb["mask"].sum() / m
        return part * factor, one, {"loss_sum": part.detach()}

    parts = MicroBatches(data, seq_len, data[0]["input_ids"].shape[0], view=CPView())
    store = run_schedule(chunks, parts, forward_only=False, loss_func=loss_func)
    return float(sum(d["loss_sum"] for d in store))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(spec, precision: str, steps: int, data, args, device, init=None, lr=None):
    """Build, (load `init`), train `steps` steps. Returns (run: losses, step times, grad norms,
    peak memory; the starting weights, full names -> fp32, for the next run)."""

    opts = resolve_build_options(
        precision=precision, attention=args.attention, recompute=args.recompute, device=device
    )
    spec = replace(spec, params_dtype=DTYPES[precision])
    config = mm.transformer_config(spec, cpu=device.type != "cuda", **opts.config_fields())
    chunks = mm.build_model_chunks(
        spec,
        config=config,
        layer_spec=opts.layer_spec(spec, config),
        ddp_config_overrides=ddp_overrides(precision, device),
    )
    if init is None:
        init = {
            n: p.detach().float().clone()
            for n, (p, _) in full_shape.local_to_full_names(chunks).items()
        }
    else:
        full_shape.load_full_state_dict(
            chunks, init
        )  # before the optimiser copies its main weights
    lr = args.lr if lr is None else lr
    section = OptimizerSection(lr=lr, warmup_steps=args.warmup_steps, grad_clip=1.0)
    optimizer = build_optimizer(chunks, section, precision=precision, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds, norms = [], [], []
    for step in range(steps):
        apply_lr_schedule(optimizer, step, lr=section.lr, warmup_steps=section.warmup_steps)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(lm_forward_backward(chunks, data, args.seq_len, args.logprob_chunk_size))
        _, grad_norm = optimizer.step()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        norms.append(grad_norm)
    run = {
        "precision": precision,
        "lr": lr,
        "attention": opts.attention,
        "losses": losses,
        "step_seconds": seconds,
        "grad_norms": norms,
        "optimizer": type(optimizer).__name__,
    }
    if device.type == "cuda":
        run["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    del chunks, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run, init


def curves_agree(losses: list[float], reference: list[float], rel_tol: float) -> dict:
    """|losses[i] - reference[i]| <= rel_tol x |reference[i]| at every step both have."""
    n = min(len(losses), len(reference))
    if n == 0:
        raise ValueError("losses: no step to compare")
    rel = [abs(a - b) / abs(b) for a, b in zip(losses[:n], reference[:n], strict=True)]
    return {"steps": n, "max_rel_diff": max(rel), "rel_tol": rel_tol, "ok": max(rel) <= rel_tol}


def loss_fell(losses: list[float], min_drop: float) -> dict:
    """Whether the last loss is at least `min_drop` below the first."""
    drop = losses[0] - losses[-1]
    return {
        "first": losses[0],
        "last": losses[-1],
        "drop": drop,
        "min_drop": min_drop,
        "ok": drop >= min_drop,
    }


def throughput(run: dict, shape, args, device_name: str) -> dict:
    """Tokens per second and MFU of a run's timed steps (planning.flops' formula)."""
    timed = run["step_seconds"][args.timing_warmup :]
    median = statistics.median(timed)
    seq_lens = [args.seq_len] * args.sequences
    model_flops = flops.training_flops(shape, seq_lens)
    full = flops.training_flops(shape, seq_lens, attention="full")
    peak = args.peak_tflops if args.peak_tflops is not None else flops.peak_tflops(device_name)
    out = {
        "timed_steps": len(timed),
        "median_step_s": median,
        "tokens_per_s": args.sequences * args.seq_len / median,
        "matmul_parameters": flops.matmul_parameters(shape),
        "model_flops_per_step": model_flops,
        "model_flops_per_step_full_attention": full,
        "formula": "per sequence of S tokens: 6 N S + 12 L H d S (S + 1) / 2 (causal pairs); "
        "full-attention variant (PaLM): 12 L H d S^2",
        "peak_tflops": peak,
        "peak_source": (
            "--peak-tflops"
            if args.peak_tflops is not None
            else flops.PEAK_SOURCE
            if peak is not None
            else None
        ),
        "mfu": None,
        "mfu_full_attention": None,
    }
    if peak is not None and run["precision"] == "bf16":
        out["mfu"] = flops.mfu(model_flops, median, peak)
        out["mfu_full_attention"] = flops.mfu(full, median, peak)
    return out


def run_benchmark(args) -> dict:
    device = torch.device(args.device)
    _check_args(args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # megatron-core builds parameters on the current device
    spec = model_spec(args, seq_len=args.seq_len, dtype=DTYPES[args.dtype])
    tokens = synthetic_tokens(args, spec.vocab_size).to(device)
    # grpo_step's default: an explicit causal mask on the CPU, megatron-core's own on CUDA
    data = lm_microbatches(tokens, args.micro_batches, CPView(causal_mask=device.type != "cuda"))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host CPU"
    setup(ParallelLayout(dp=None), seed=args.seed)
    try:
        main_run, init = train_run(spec, args.dtype, args.steps, data, args, device)
        runs = {"timed": main_run}
        if args.compare_dtype != "none":
            runs["compare"], _ = train_run(
                spec,
                args.compare_dtype,
                args.compare_steps,
                data,
                args,
                device,
                init,
                lr=args.compare_lr,
            )
    finally:
        teardown()
    out = {
        "device": str(device),
        "device_name": device_name,
        "shape": args.shape,
        "parameters": spec.num_parameters(),
        "tokens_per_step": args.sequences * args.seq_len,
        "data": {"block": args.block, "data_vocab": args.data_vocab, "seed": args.seed},
        "runs": runs,
        "loss_fell": loss_fell(main_run["losses"], args.min_drop),
        "throughput": throughput(main_run, spec, args, device_name),
    }
    if "compare" in runs:
        out["precision_comparison"] = {
            "pair": [args.dtype, args.compare_dtype],
            **curves_agree(main_run["losses"], runs["compare"]["losses"], args.rel_tol),
        }
    out["ok"] = out["loss_fell"]["ok"] and out.get("precision_comparison", {}).get("ok", True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = run_benchmark(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    t, fell = out["throughput"], out["loss_fell"]
    print(
        f"train-lm on {out['device']} ({out['device_name']}), {args.shape}: "
        f"{out['parameters']:,} parameters, {out['tokens_per_step']:,} tokens per step"
    )
    for name, run in out["runs"].items():
        losses = " ".join(f"{x:.3f}" for x in run["losses"])
        print(f"{name} ({run['precision']}, {run['attention']} attention): {losses}")
    print(f"loss fell by {fell['drop']:.3f} nats (needs {fell['min_drop']}): {fell['ok']}")
    if "precision_comparison" in out:
        c = out["precision_comparison"]
        print(
            f"{c['pair'][0]} vs {c['pair'][1]}: max rel diff {c['max_rel_diff']:.2e} over "
            f"{c['steps']} steps (tolerance {c['rel_tol']}): {c['ok']}"
        )
    mfu = "n/a" if t["mfu"] is None else f"{t['mfu']:.3f}"
    print(f"median step {t['median_step_s']:.4f} s, {t['tokens_per_s']:,.0f} tokens/s, MFU {mfu}")
    return 0 if out["ok"] else 1
