"""Chunked vocab-parallel log-prob + entropy against the naive fp32 path: peak memory and time.

    megatron-ba perf vocab-parallel                  # T=16384, vocab 151936 / TP 8, bf16 shard
    megatron-ba perf vocab-parallel --tokens 2048 --rounds 2 --chunk-sizes 256
    megatron-ba perf vocab-parallel --device cuda --json vp.json    # a GPU (gpu_check.sh)
    python megatron_ba/perf/vocab_parallel_perf.py --help        # the same without the CLI

Work measured: forward + backward of sum(w_lp * logprob) + sum(w_h * entropy) (random w) over
one TP rank's logits shard [T, V/TP], with `tp_group=None`. That is a rank's whole [T, V/TP]
work; what TP adds is one all-gather of 3 x T fp32 statistics per rank (O(T), printed below),
which is why one rank is emulated instead of launching TP gloo processes on a 2-core machine.

Variants: `naive` (logits.float() / temperature, log_softmax, gather, -(p * log p).sum(), all
through autograd), `unchunked` (vocab_parallel_logprobs, chunk_size=None) and `chunked:C`.

* Memory: each variant runs in a fresh subprocess. With the inputs allocated and after a small
  warm-up, the kernel's resident-set high-water mark is reset (/proc/self/clear_refs = 5); the
  peak extra memory is VmHWM after one forward+backward minus VmRSS before it (glibc's malloc
  set to map every tensor over 64 KiB separately, so freed memory leaves RSS). It includes the
  gradient w.r.t. the logits (T x V/TP in the logits' dtype, which every variant must return).
  Also printed: the bytes autograd saves for backward besides the logits (saved_tensors_hooks).
  On an accelerator (--device cuda) the peak extra memory is instead
  torch.cuda.max_memory_allocated during the forward+backward (reset before it) minus the memory
  allocated before it: the same quantity, read from the caching allocator.
* Time: one subprocess holding the inputs runs every variant in rotating order for --rounds
  rounds (the machine may be shared; interleaving keeps the comparison fair); median and min.
  On an accelerator each timed step ends with a device synchronisation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIB = 2**20


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="megatron-ba perf vocab-parallel")
    p.add_argument("--tokens", type=int, default=16384, help="T, tokens per rank")
    p.add_argument("--vocab", type=int, default=151936, help="global vocabulary size")
    p.add_argument("--tp", type=int, default=8, help="TP size: the shard is vocab / tp")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the logits")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-sizes", default="64,256,1024", help="comma-separated chunk sizes")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of the logits (e.g. cuda, cuda:1); default the host CPU",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--worker", choices=["memory", "time"], help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", help=argparse.SUPPRESS)
    return p


# --- the work -------------------------------------------------------------------------------------


def naive(logits, targets, temperature):
    """What a loss written without vocab-parallel care does: whole fp32 tensors in autograd."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def step(variant, logits, targets, w_lp, w_h, temperature):
    if variant == "naive":
        lp, h = naive(logits, targets, temperature)
    else:
        chunk = None if variant == "unchunked" else int(variant.split(":", 1)[1])
        lp, h = vocab_parallel_logprobs(
            logits, targets, temperature=temperature, chunk_size=chunk, with_entropy=True
        )
    ((w_lp * lp).sum() + (w_h * h).sum()).backward()
    return lp.detach(), h.detach()


def _accelerator(device: torch.device) -> bool:
    """True when `device` is this machine's accelerator (CUDA), False for the host."""
    accel = torch.accelerator.current_accelerator()
    return accel is not None and device.type == accel.type


def _sync(device: torch.device) -> None:
    if _accelerator(device):
        torch.cuda.synchronize(device)


def make_inputs(args):
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)  # host generator: the same numbers everywhere
    t, v_local = args.tokens, args.vocab // args.tp
    logits = torch.empty(t, v_local, dtype=DTYPES[args.dtype], device=device)
    for a in range(0, t, 512):  # filled in slices: no [T, V/TP] fp32 temporary
        b = min(a + 512, t)
        logits[a:b] = (torch.randn(b - a, v_local, generator=g) * 2.0).to(device)
    targets = torch.randint(0, v_local, (t,), generator=g)  # ids of this (emulated) rank
    w_lp, w_h = torch.randn(t, generator=g), torch.randn(t, generator=g)
    return logits.requires_grad_(), targets.to(device), w_lp.to(device), w_h.to(device)


def _proc_status_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        rows = (line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return {k: int(v.split()[0]) for k, v in rows}


def worker_memory(args) -> dict:
    (variant,) = args.variant
    device = torch.device(args.device)
    accel = _accelerator(device)
    logits, targets, w_lp, w_h = make_inputs(args)
    warm = logits[:64].detach().clone().requires_grad_()  # warm-up kernels at a small size
    step(variant, warm, targets[:64], w_lp[:64], w_h[:64], args.temperature)
    del warm
    gc.collect()
    if accel:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _proc_status_kib()
    saved = [0]

    def pack(tensor):
        if tensor.data_ptr() != logits.data_ptr():
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(variant, logits, targets, w_lp, w_h, args.temperature)
    _sync(device)
    seconds = time.perf_counter() - t0
    if accel:
        peak_extra = (torch.cuda.max_memory_allocated(device) - allocated_before) / MIB
    else:
        after = _proc_status_kib()
        peak_extra = (after["VmHWM"] - before["VmRSS"]) / 1024
    return {
        "variant": variant,
        "peak_extra_mib": peak_extra,
        "saved_mib": saved[0] / MIB,
        "grad_mib": logits.grad.numel() * logits.grad.element_size() / MIB,
        "first_run_s": seconds,
    }


def worker_time(args) -> dict:
    variants = args.variant
    logits, targets, w_lp, w_h = make_inputs(args)
    times: dict[str, list[float]] = {v: [] for v in variants}
    ref = None
    diffs: dict[str, float] = {}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            logits.grad = None
            gc.collect()
            _sync(logits.device)
            t0 = time.perf_counter()
            lp, h = step(v, logits, targets, w_lp, w_h, args.temperature)
            _sync(logits.device)
            times[v].append(time.perf_counter() - t0)
            if r == 0:  # sanity: every variant computes the same numbers as the first one
                ref = ref or (lp, h)
                diffs[v] = max(float((lp - ref[0]).abs().max()), float((h - ref[1]).abs().max()))
    return {"times_s": times, "max_abs_diff_vs_first": diffs}


# --- the driver -----------------------------------------------------------------------------------


def _run_worker(args, mode: str, variants: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode]
    names = ("tokens", "vocab", "tp", "dtype", "temperature", "seed", "rounds", "threads", "device")
    for name in names:
        cmd += [f"--{name}", str(getattr(args, name))]
    for v in variants:
        cmd += ["--variant", v]
    env = dict(os.environ)
    if mode == "memory":
        # glibc would keep freed blocks of up to 32 MiB resident for reuse (its mmap threshold
        # adapts), hiding chunk buffers in the baseline; a fixed 64 KiB threshold makes every
        # larger tensor its own mapping, so RSS follows live tensors.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        result = worker_memory(args) if args.worker == "memory" else worker_time(args)
        print(json.dumps(result))
        return 0
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} is not divisible by --tp {args.tp}")
    chunks = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    variants = ["naive", "unchunked"] + [f"chunked:{c}" for c in chunks]
    v_local = args.vocab // args.tp
    print(
        f"T={args.tokens} vocab={args.vocab} TP={args.tp} (shard {v_local}) {args.dtype} "
        f"temperature={args.temperature} threads={args.threads or torch.get_num_threads()} "
        f"device={args.device}; "
        f"TP all-gather payload per rank: {3 * 4 * args.tokens} bytes"
    )
    memory = {v: _run_worker(args, "memory", [v]) for v in variants}
    timing = _run_worker(args, "time", variants)
    naive_mem = memory["naive"]["peak_extra_mib"]
    naive_t = statistics.median(timing["times_s"]["naive"])
    print(
        f"{'variant':<14} {'peak extra MiB':>14} {'/naive':>7} {'saved MiB':>10} "
        f"{'median s':>9} {'min s':>7} {'/naive':>7} {'max|diff|':>10}"
    )
    rows = []
    for v in variants:
        m, ts = memory[v], timing["times_s"][v]
        row = {
            **m,
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            # (tiny sizes can leave naive's RSS growth at 0: all reuse of freed malloc memory)
            "memory_ratio": m["peak_extra_mib"] / naive_mem if naive_mem > 0 else float("nan"),
            "time_ratio": statistics.median(ts) / naive_t,
            "max_abs_diff_vs_naive": timing["max_abs_diff_vs_first"][v],
        }
        rows.append(row)
        print(
            f"{v:<14} {row['peak_extra_mib']:>14.0f} {row['memory_ratio']:>7.3f} "
            f"{row['saved_mib']:>10.1f} {row['median_s']:>9.2f} {row['min_s']:>7.2f} "
            f"{row['time_ratio']:>7.2f} {row['max_abs_diff_vs_naive']:>10.1e}"
        )
    print(f"(peak extra includes the {memory['naive']['grad_mib']:.0f} MiB logits gradient)")
    for row in rows:
        if row["variant"].startswith("chunked"):
            ok_m, ok_t = row["memory_ratio"] <= 1 / 8, row["time_ratio"] <= 1.15
            print(
                f"{row['variant']}: memory <= 1/8 of naive: {'yes' if ok_m else 'NO'}; "
                f"time <= 1.15x naive: {'yes' if ok_t else 'NO'}"
            )
    if args.json:
        with open(args.json, "w") as f:
            memory_kind = (
                "torch.cuda.max_memory_allocated - allocated before"
                if _accelerator(torch.device(args.device))
                else "VmHWM - VmRSS before"
            )
            result = {"args": vars(args), "rows": rows, "times_s": timing["times_s"]}
            json.dump({**result, "memory_kind": memory_kind}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
