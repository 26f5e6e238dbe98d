"""The SDPA core attention against megatron-core's unfused one on this device: error, memory, time.

    megatron-ba perf attention --device cuda --dtypes bf16,fp32 --memory-seq-len 8192
    megatron-ba perf attention --device cpu --seq-len 64 --memory-seq-len 128    # plumbing

Accuracy: causal attention of --batch sequences of --seq-len tokens, --heads query heads in
--groups key/value groups of --head-dim (default Qwen2.5-0.5B's 14 / 2 / 64), random q, k, v in
each dtype. Both cores (megatron_ba.megatron.sdpa_attention.SDPAttention, megatron-core's
DotProductAttention) compute the output and the q/k/v gradients of a fixed linear function of it;
each is compared with a float64 reference on the same (rounded) inputs, as the largest relative
error over those four tensors. Criterion (exit status 1 otherwise): the SDPA core's error is at
most twice the unfused core's plus 1e-6, i.e. it is as accurate as megatron-core's own kernel
in that dtype. The kernels torch picks are those of the device (flash, memory-efficient, cuDNN on
CUDA): tests/test_sdpa_attention.py proves the function in float64 on the CPU; this checks it
where the GPU kernels run.

Memory and time: forward + backward of one --memory-seq-len sequence in the first dtype, each
core alone: the peak allocated above what was live before (torch.cuda.max_memory_allocated; not
measured on the CPU) and the median of 3 timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_ba.megatron.batching import causal_mask
from megatron_ba.megatron.startup import setup, teardown
from megatron_ba.parallel.parallel_layout import ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2**20


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = p or argparse.ArgumentParser(prog="megatron-ba perf attention")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (accuracy)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", default="bf16,fp32" if cuda else "fp32", help="comma-separated")
    p.add_argument("--memory-seq-len", type=int, default=8192, help="0: no memory/time run")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def _cores(args, dtype: torch.dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron-core (sdpa_attention imports it at module level): imported on use
    from megatron_ba.megatron.sdpa_attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        kv_channels=args.head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,  # the unfused core's plain torch softmax (no fused kernel)
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    causal = AttnMaskType.causal
    return {
        "sdpa": SDPAttention(config, 1, causal, "self"),
        "unfused": DotProductAttention(config, 1, causal, "self"),
    }


def reference(q, k, v, scale: float) -> torch.Tensor:
    """float64 causal attention, [s, b, heads, d] in (k, v: groups), [s, b, heads x d] out."""
    r = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(r, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    s = q.shape[0]
    cut = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    probs = torch.softmax(scores.masked_fill(cut, float("-inf")), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).flatten(2)


def _inputs(args, s: int, b: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(s, b, args.heads, args.head_dim), (s, b, args.groups, args.head_dim)]
    q, k, v = (torch.randn(shapes[min(i, 1)], generator=g) for i in range(3))
    w = torch.randn(s, b, args.heads * args.head_dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, w)]


def _forward_backward(core, q, k, v, w, mask) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = core(*leaves, mask)
    (out.float() * w.float()).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300))


def accuracy(args, dtype_name: str, device, mask) -> dict:
    dtype = DTYPES[dtype_name]
    q, k, v, w = _inputs(args, args.seq_len, args.batch, dtype, device, args.seed)
    exact = [t.double() for t in (q, k, v, w)]
    ref = _forward_backward(
        lambda a, b, c, _m: reference(a, b, c, args.head_dim**-0.5), *exact, None
    )
    errors = {}
    for name, core in _cores(args, dtype).items():
        got = _forward_backward(core, q, k, v, w, mask)
        errors[name] = max(_rel(x, y) for x, y in zip(got, ref, strict=True))
    ok = errors["sdpa"] <= 2 * errors["unfused"] + 1e-6
    return {"sdpa_rel_err": errors["sdpa"], "unfused_rel_err": errors["unfused"], "ok": ok}


def memory_and_time(args, device, mask_for) -> dict:
    """Each core's peak extra memory (CUDA) and median seconds of forward + backward."""
    dtype_name = args.dtypes.split(",")[0]
    s = args.memory_seq_len
    q, k, v, w = _inputs(args, s, 1, DTYPES[dtype_name], device, args.seed + 1)
    mask = mask_for(s)
    out = {"seq_len": s, "dtype": dtype_name}
    for name, core in _cores(args, DTYPES[dtype_name]).items():
        seconds = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            _forward_backward(core, q, k, v, w, mask)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        peak = None
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - base) / MIB
        out[name] = {"peak_extra_mib": peak, "median_s": statistics.median(seconds)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    unknown = set(args.dtypes.split(",")) - set(DTYPES)
    if unknown or (device.type != "cuda" and "bf16" in args.dtypes):
        raise SystemExit(f"--dtypes {args.dtypes}: fp32 and bf16 (bf16 on CUDA only here)")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def mask_for(s: int):
        # megatron_ba's step: megatron-core's own causal mask on CUDA, an explicit one on the CPU
        return None if device.type == "cuda" else causal_mask(s, device=device)

    setup(ParallelLayout(dp=None), seed=args.seed)
    try:
        out = {"device": str(device), "shape": [args.heads, args.groups, args.head_dim]}
        out["accuracy"] = {
            d: accuracy(args, d, device, mask_for(args.seq_len)) for d in args.dtypes.split(",")
        }
        if args.memory_seq_len:
            out["memory"] = memory_and_time(args, device, mask_for)
    finally:
        teardown()
    out["ok"] = all(a["ok"] for a in out["accuracy"].values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    for d, a in out["accuracy"].items():
        print(
            f"{d}: relative error vs float64, sdpa {a['sdpa_rel_err']:.2e}, unfused "
            f"{a['unfused_rel_err']:.2e}: {'ok' if a['ok'] else 'SDPA WORSE'}"
        )
    for name in ("sdpa", "unfused"):
        m = out.get("memory", {}).get(name)
        if m:
            print(
                f"{name} at {out['memory']['seq_len']} tokens: peak extra {m['peak_extra_mib']} "
                f"MiB, {m['median_s']:.4f} s"
            )
    return 0 if out["ok"] else 1
