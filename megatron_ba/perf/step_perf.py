"""A whole megatron-core GRPO step with the BA plan vs the token-mean plan: time and peak memory.

    megatron-ba perf step                                   # tiny shape on this machine's device
    megatron-ba perf step --shape small --seq-len 2048 --sequences 32 --dtype bf16 --device cuda
    python -m megatron_ba.perf.step_perf --help

One step = `megatron_ba.megatron.grpo_step.forward_backward` (megatron-core's schedule over
--micro-batches micro-batches, the loss plan with its DP statistics all-reduce, the vocab-parallel
log-probs, finalize_model_grads) + the optimiser step: `ShardedAdamW` for fp32 parameters,
megatron-core's `get_megatron_optimizer` (bf16 parameters, fp32 main weights) for bf16. The two
variants differ in `loss.rule` alone: "balanced" (BA) and "token" (the token-mean plan); both run
the same model, batch and optimiser, interleaved in rotating order after --warmup steps of each so
that load drifts hit both alike. Reported: median and min seconds per step, the ratio of medians
BA / token-mean (goal on a GPU: <= 1.02x), and peak memory per variant:
`torch.cuda.max_memory_allocated` (reset before every step) on an accelerator, the process's
resident-set high-water mark (VmHWM, reset before every step via /proc/self/clear_refs) on CPU.

The batch is synthetic: --sequences sequences of --seq-len tokens (a --prompt-len prompt, then a
response of uniform random length in [1, seq_len - prompt_len], right padding), groups of
--group-size, binary rewards minus the group mean as advantages, old log-probs = the model's own
minus a small random offset (ratios near 1, as in a real step). A world of one process (DP=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.megatron import model as mm
from megatron_ba.megatron.batching import GRPOBatch
from megatron_ba.megatron.build_options import resolve_build_options
from megatron_ba.megatron.grpo_step import (
    MicroBatchSpec,
    compute_logprobs,
    forward_backward,
)
from megatron_ba.megatron.optimizer_choice import build_optimizer, ddp_overrides
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.perf.shapes import add_shape_arguments, model_spec
from megatron_ba.recipe import OptimizerSection
from megatron_ba.step_settings import StepSettings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RULES = ("balanced", "token")  # BA, token-mean: the only difference between the two variants
MIB = 2**20


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="megatron-ba perf step")
    add_shape_arguments(p)
    p.add_argument("--sequences", type=int, default=16, help="sequences per step (N)")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--seq-len", type=int, default=256, help="prompt + response tokens (S)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--logprob-chunk-size", type=int, default=None, help="None: unchunked")
    p.add_argument(
        "--recompute",
        choices=("none", "full"),
        default="none",
        help="full: megatron-core's full activation recomputation, one layer at a time",
    )
    p.add_argument(
        "--transformer-impl",
        choices=("auto", "local", "transformer_engine"),
        default="auto",
        help="layer spec; auto: Transformer Engine when it imports on an accelerator, else local",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "sdpa", "unfused"),
        default="auto",
        help="the local spec's core attention (model.attention); auto: sdpa on CUDA",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device of the step (default: CUDA when available, else the CPU)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="parameter dtype")
    p.add_argument("--repeats", type=int, default=5, help="timed steps of each variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each variant first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def _spec(args) -> mm.ModelSpec:
    return model_spec(args, seq_len=args.seq_len, dtype=DTYPES[args.dtype])


def _check_args(args) -> None:
    if args.sequences % args.group_size:
        raise SystemExit(f"--sequences {args.sequences}: not a multiple of --group-size")
    if args.sequences % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches}: must divide --sequences")
    if not 1 <= args.prompt_len < args.seq_len:
        raise SystemExit(f"--prompt-len {args.prompt_len}: must be in [1, --seq-len)")
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")


def _accelerator(device: torch.device) -> bool:
    """True when `device` is this machine's accelerator (CUDA here), False for the host."""
    accel = torch.accelerator.current_accelerator()
    return accel is not None and device.type == accel.type


def _batch(args, spec: mm.ModelSpec, chunks, device: torch.device) -> GRPOBatch:
    g = torch.Generator().manual_seed(args.seed)
    n, s, p = args.sequences, args.seq_len, args.prompt_len
    tokens = torch.randint(0, spec.vocab_size, (n, s), generator=g)
    lengths = torch.randint(1, s - p + 1, (n,), generator=g)
    pos = torch.arange(s)[None, :]
    mask = (pos >= p) & (pos < p + lengths[:, None])
    groups = torch.arange(n // args.group_size).repeat_interleave(args.group_size)
    rewards = (torch.rand(n, generator=g) < 0.5).float()
    group_mean = torch.zeros(n // args.group_size).index_add_(0, groups, rewards) / args.group_size
    advantages = rewards - group_mean[groups]
    tokens = tokens.to(device)
    own, _ = compute_logprobs(chunks, tokens, MicroBatchSpec(args.micro_batches))
    old = own - 0.01 * torch.rand(n, s, generator=g).to(device)
    return GRPOBatch(
        tokens, mask.to(device), advantages.to(device), groups.to(device), old, lengths=None
    )


def _optimizer(chunks, dtype: torch.dtype, device: torch.device):
    """The trainer's own choice (megatron/optimizer_choice.build_optimizer): ShardedAdamW for
    fp32, megatron-core's distributed optimiser (bf16 params, fp32 main weights) for bf16."""

    precision = "fp32" if dtype == torch.float32 else "bf16"
    optimizer = build_optimizer(
        chunks, OptimizerSection(lr=1e-6, grad_clip=1.0), precision=precision, device=device
    )
    return optimizer, type(optimizer).__name__


def _rss_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        rows = (line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return {k: int(v.split()[0]) for k, v in rows}


class _Meter:
    """Wall time and peak memory of one step on `device` (synchronised on an accelerator)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.accel = device, _accelerator(device)

    def __enter__(self):
        if self.accel:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.accel:
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
        if self.accel:
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / MIB
            # what the caching allocator held at its peak: the allocations plus its slack
            self.peak_reserved_mib = torch.cuda.max_memory_reserved(self.device) / MIB
        else:
            self.peak_mib = self.peak_reserved_mib = _rss_kib()["VmHWM"] / 1024
        return False


def run_benchmark(args) -> dict:
    # Long on purpose: set-up, the timed loop over the rules and the figures are one measurement
    # (a script's body, not a library function); its pieces would pass a dozen locals around.
    _check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    accel = _accelerator(device)
    if args.dtype == "bf16" and not accel:
        raise SystemExit(
            f"--dtype bf16: needs a CUDA device (megatron-core's optimiser), got {device}"
        )
    if args.recompute == "full" and not accel:
        # megatron-core 0.16.1's CheckpointFunction saves and restores CUDA RNG states.
        raise SystemExit(f"--recompute full: needs a CUDA device, got {device}")
    if accel:
        torch.cuda.set_device(device)  # megatron-core builds parameters on the current device
    setup(ParallelLayout(dp=None), seed=args.seed)
    try:
        spec = _spec(args)
        # The trainer's own resolution of precision, layer spec ("auto": Transformer Engine
        # when it imports on a GPU) and recomputation (train/policy.py builds through it too).
        opts = resolve_build_options(
            precision=args.dtype,
            transformer_impl=args.transformer_impl,
            attention=args.attention,
            recompute=args.recompute,
            device=device,
        )
        impl = opts.transformer_impl
        config = mm.transformer_config(spec, cpu=not accel, **opts.config_fields())
        chunks = mm.build_model_chunks(
            spec,
            config=config,
            layer_spec=opts.layer_spec(spec, config),
            # the distributed optimiser needs DDP's contiguous buffers (as the trainer builds)
            ddp_config_overrides=ddp_overrides(args.dtype, device),
        )
        optimizer, optimizer_name = _optimizer(chunks, spec.params_dtype, device)
        batch = _batch(args, spec, chunks, device)
        split = MicroBatchSpec(args.micro_batches, logprob_chunk_size=args.logprob_chunk_size)
        groups = args.sequences // args.group_size
        settings_of = {r: StepSettings(AggregationSettings(rule=r)) for r in RULES}
        times: dict[str, list[float]] = {r: [] for r in RULES}
        peaks: dict[str, list[float]] = {r: [] for r in RULES}
        reserved: dict[str, list[float]] = {r: [] for r in RULES}
        losses: dict[str, float] = {}
        for i in range(args.warmup + args.repeats):
            order = RULES[i % 2 :] + RULES[: i % 2]  # rotate which variant goes first
            for rule in order:
                with _Meter(device) as m:
                    result = forward_backward(
                        chunks, batch, settings_of[rule], split, num_groups=groups
                    )
                    optimizer.step()
                    optimizer.zero_grad()
                losses[rule] = float(result.loss)
                if i >= args.warmup:
                    times[rule].append(m.seconds)
                    peaks[rule].append(m.peak_mib)
                    reserved[rule].append(m.peak_reserved_mib)
    finally:
        teardown()
    med = {r: statistics.median(times[r]) for r in RULES}
    out = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if accel else "host CPU",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "optimizer": optimizer_name,
        "transformer_impl": impl,
        "attention": opts.attention,
        "recompute": args.recompute,
        "parameters": spec.num_parameters(),
        "tokens_per_step": int(batch.tokens.numel()),
        "response_tokens_per_step": int(batch.response_mask.sum()),
        "memory_kind": "torch.cuda.max_memory_allocated" if accel else "VmHWM (process RSS peak)",
        "ratio_ba_over_token_mean": med["balanced"] / med["token"],
        # the steps of one repeat ran back to back: their ratio cancels slow load drifts
        "paired_ratio_median": statistics.median(
            b / t for b, t in zip(times["balanced"], times["token"], strict=True)
        ),
        "goal_ratio_max": 1.02,
    }
    for rule, name in zip(RULES, ("ba", "token_mean"), strict=True):
        out[f"{name}_median_s"] = med[rule]
        out[f"{name}_min_s"] = min(times[rule])
        out[f"{name}_times_s"] = times[rule]
        out[f"{name}_peak_mib"] = max(peaks[rule])
        out[f"{name}_peak_reserved_mib"] = max(reserved[rule])
        out[f"{name}_last_loss"] = losses[rule]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = run_benchmark(args)
    print(
        f"GRPO step on {out['device']} ({out['device_name']}), {args.shape} Qwen2 shape, "
        f"{out['parameters']:,} parameters, {out['dtype']}, {out['optimizer']}, "
        f"{out['transformer_impl']} layers, recompute {out['recompute']}; "
        f"{args.sequences} x {args.seq_len} tokens ({out['response_tokens_per_step']:,} response), "
        f"{args.micro_batches} micro-batches, {args.repeats} repeats after {args.warmup} warm-up, "
        f"threads={out['threads']}"
    )
    print(f"{'plan':<12} {'median s':>9} {'min s':>8} {'peak MiB':>9}")
    for name, label in (("ba", "BA"), ("token_mean", "token-mean")):
        print(
            f"{label:<12} {out[name + '_median_s']:>9.4f} {out[name + '_min_s']:>8.4f} "
            f"{out[name + '_peak_mib']:>9.1f}"
        )
    ratio = out["ratio_ba_over_token_mean"]
    met = "yes" if ratio <= out["goal_ratio_max"] else "NO"
    print(f"BA / token-mean (medians): {ratio:.3f}x (goal <= 1.02x: {met})")
    print(f"BA / token-mean, median of the repeats' ratios: {out['paired_ratio_median']:.3f}x")
    print(f"peak memory: {out['memory_kind']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
