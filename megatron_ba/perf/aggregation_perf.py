"""Benchmark: planning + applying balanced aggregation vs token-mean (forward and backward).

    megatron-ba perf aggregation                       # 2,048 sequences of up to 16,384 tokens
    megatron-ba perf aggregation --sequences 256 --max-length 2048 --repeats 5
    megatron-ba perf aggregation --device cuda --json  # scripts/gpu_check.py's aggregation stage
    python -m megatron_ba.perf.aggregation_perf --threads 2

Both layouts the loss supports are measured: padded [N, T] with a mask and packed (concatenated
tokens). "token-mean" is the conventional masked mean (verl `token-mean`, DAPO): sum(x * mask) /
sum(mask); for packed batches also the unmasked mean of a pack holding loss tokens only.
"balanced" is the project's path: `sequence_weights` (the plan, from lengths, advantages
and group ids) then `apply_weights`. Each variant runs forward + backward of the scalar w.r.t. the
token values; medians over repeats, variants interleaved so that load drifts hit all alike.
Planning alone is timed separately (goal: O(N), < 1 ms for N = 2,048).

The packed GRPO loss (`grpo_loss`, forward + backward of the clipped loss and its metrics over a
packed batch of log-probs) is timed for both rules side by side: "balanced" is `LossPlan.build`
plus `grpo_loss`; "token-mean" is `token_mean_grpo_loss` below, the conventional clipped loss
divided by the token count, with the same metrics (goal: balanced <= 1.05x token-mean).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_ba.aggregation import (
    _WeightedSum,
    apply_weights,
    apply_weights_packed,
    sequence_weights,
    token_weights,
)
from megatron_ba.loss import MAX_LOG_RATIO, GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings


def _batch(n: int, max_length: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_length + 1, (n,), generator=g)
    rewards = (torch.rand(n, generator=g) < 0.5).float()
    adv = rewards - 0.5
    ids = torch.arange(n // group_size).repeat_interleave(group_size)[:n]
    return lengths, adv, ids


def token_mean_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    index: torch.Tensor,
    advantages: torch.Tensor,
    config: GRPOLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO loss of a packed batch as a token-mean implementation writes it (verl
    `token-mean`, DAPO): each token's advantage gathered from its sequence's by the sequence
    index (-1: padding), phi = min(rho A, clip(rho) A), loss = -sum phi / tokens; no weights.
    With grpo_loss's metrics (a sign's weight: its tokens / tokens), it gives what grpo_loss gives
    under the token rule's batch scope (tests/test_bench_aggregation.py)."""
    config = config or GRPOLossConfig()
    dtype = logprobs.dtype
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    valid = index >= 0
    adv = torch.take(torch.cat([advantages.to(dtype), zero[None]]), index.clamp(min=-1))
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    phi = torch.minimum(ratio * adv, clipped * adv)  # 0 on padding (A = 0 there, rho = 1)
    if config.dual_clip is not None:
        phi = torch.where(adv < 0, torch.maximum(phi, config.dual_clip * adv), phi)
    n_tokens = torch.count_nonzero(valid)
    denom = n_tokens.clamp(min=1).to(dtype)
    loss = -phi.sum() / denom
    with torch.no_grad():
        pos = torch.count_nonzero(adv > 0) / denom
        neg = torch.count_nonzero(adv < 0) / denom
        dual = config.dual_clip
        metrics = {
            "pg_loss": loss.detach(),
            "clip_low_frac": torch.count_nonzero((adv < 0) & (ratio < 1 - config.clip_low)) / denom,
            "clip_high_frac": torch.count_nonzero((adv > 0) & (ratio > 1 + config.clip_high))
            / denom,
            "dual_clip_frac": zero
            if dual is None
            else torch.count_nonzero((adv < 0) & (ratio > dual)) / denom,
            "num_tokens_sum": n_tokens.to(dtype),
            "weight_pos_sum": pos,
            "weight_neg_sum": neg,
            "weight_pos_share": torch.where(
                pos + neg > 0, pos / (pos + neg).clamp(min=1e-30), zero
            ),
            "ratio_mean": torch.where(valid, ratio, zero).sum() / denom,
        }
    return loss, metrics


def _time(fn, repeats: int, device: torch.device) -> list[float]:
    """Wall seconds of each call; on CUDA each waits for the kernels it queued."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def run_benchmark(n, max_length, group_size, repeats, seed=0, device="cpu") -> dict:
    """Median ms of every variant; the batch is drawn on the CPU (the same numbers on any device)
    and moved to `device`."""
    # Long on purpose: the timed variants are closures over one batch, side by side, so that
    # what is compared reads in one place (a measurement script, not a library function).
    device = torch.device(device)
    lengths, adv, ids = (t.to(device) for t in _batch(n, max_length, group_size, seed))
    T = int(lengths.max())
    mask = torch.arange(T, device=device)[None, :] < lengths[:, None]
    padded = torch.randn(n, T, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    padded.requires_grad_()
    num_tokens = int(lengths.sum())
    packed = torch.randn(num_tokens, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    packed.requires_grad_()
    packed_mask = torch.ones(num_tokens, device=device)  # the loss mask a packed batch carries

    def token_mean_padded():
        m = mask.to(padded.dtype)
        ((padded * m).sum() / m.sum()).backward()

    def balanced_padded():
        w = sequence_weights("balanced", lengths, adv, ids)
        apply_weights(padded, mask, w).backward()

    def token_mean_packed():
        ((packed * packed_mask).sum() / packed_mask.sum()).backward()

    def token_mean_packed_unmasked():  # a pack holding loss tokens only: no mask to apply
        (packed.sum() / num_tokens).backward()

    def balanced_packed():
        w = sequence_weights("balanced", lengths, adv, ids)
        apply_weights_packed(packed, None, w, counts=lengths).backward()

    host_counts = lengths.tolist()  # what a packer that laid the pack out knows on the host

    def balanced_packed_host_counts():
        w = sequence_weights("balanced", lengths, adv, ids)
        apply_weights_packed(packed, None, w, counts=host_counts).backward()

    # The apply alone, its per-token weight vector already built (the vector is built once per
    # micro-batch and plan: this is the multiply-sum and its backward without the build).
    prebuilt = token_weights(sequence_weights("balanced", lengths, adv, ids), lengths, packed)

    def balanced_packed_prebuilt():
        _WeightedSum.apply(packed, prebuilt).backward()

    # The packed GRPO loss: log-probs of the packed tokens, both rules on the same batch.
    gen = torch.Generator().manual_seed(seed + 3)
    logp = (-torch.rand(num_tokens, generator=gen) * 3).to(device).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(num_tokens, generator=gen).to(device)
    seq_index = torch.arange(n, device=device).repeat_interleave(lengths)

    def grpo_loss_token_mean():
        token_mean_grpo_loss(logp, old, seq_index, adv)[0].backward()

    def grpo_loss_balanced():
        plan = LossPlan.build(AggregationSettings("balanced"), lengths, adv, ids)
        grpo_loss(logp, old, seq_index, plan)[0].backward()

    variants = {
        "packed/grpo-loss-token-mean": grpo_loss_token_mean,
        "packed/grpo-loss-balanced": grpo_loss_balanced,
        "padded/token-mean": token_mean_padded,
        "padded/balanced": balanced_padded,
        "packed/token-mean": token_mean_packed,
        "packed/token-mean-unmasked": token_mean_packed_unmasked,
        "packed/balanced": balanced_packed,
        "packed/balanced-host-counts": balanced_packed_host_counts,
        "packed/balanced-apply-only": balanced_packed_prebuilt,
    }
    for fn in variants.values():  # warm-up
        fn()
    samples = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            padded.grad = packed.grad = logp.grad = None  # as after zero_grad(set_to_none=True)
            samples[k] += _time(fn, 1, device)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}

    plan_ms = (
        statistics.median(
            _time(lambda: sequence_weights("balanced", lengths, adv, ids), 200, device)
        )
        * 1e3
    )
    return {
        "sequences": n,
        "max_length": max_length,
        "tokens": num_tokens,
        "padded_shape": [n, T],
        "device": str(device),
        "threads": torch.get_num_threads(),
        "median_ms": {k: round(v, 2) for k, v in med.items()},
        "ratio_padded": round(med["padded/balanced"] / med["padded/token-mean"], 3),
        "ratio_packed": round(med["packed/balanced"] / med["packed/token-mean"], 3),
        "ratio_packed_unmasked": round(
            med["packed/balanced"] / med["packed/token-mean-unmasked"], 3
        ),
        "ratio_host_counts_unmasked": round(
            med["packed/balanced-host-counts"] / med["packed/token-mean-unmasked"], 3
        ),
        "ratio_apply_only_unmasked": round(
            med["packed/balanced-apply-only"] / med["packed/token-mean-unmasked"], 3
        ),
        "ratio_grpo_loss": round(
            med["packed/grpo-loss-balanced"] / med["packed/grpo-loss-token-mean"], 3
        ),
        "plan_ms": round(plan_ms, 3),
        "load_avg_1min": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ba perf aggregation", description=__doc__)
    p.add_argument("--sequences", type=int, default=2048)
    p.add_argument("--max-length", type=int, default=16384)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON line only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device: cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    r = run_benchmark(
        args.sequences, args.max_length, args.group_size, args.repeats, device=args.device
    )
    if args.json:
        print(json.dumps(r))
        return 0
    print(
        f"{r['sequences']} sequences, {r['tokens']:,} tokens (padded {r['padded_shape']}), "
        f"{r['device']}, {r['threads']} threads, load {r['load_avg_1min']:.2f}"
    )
    for k, v in r["median_ms"].items():
        print(f"  {k:<28} {v:10.2f} ms  (forward + backward, median)")
    print(
        f"  balanced / token-mean: padded {r['ratio_padded']:.3f}x, packed {r['ratio_packed']:.3f}x"
        f" (vs the unmasked packed mean {r['ratio_packed_unmasked']:.3f}x; with host-known "
        f"counts {r['ratio_host_counts_unmasked']:.3f}x; the apply alone, "
        f"weight vector prebuilt: {r['ratio_apply_only_unmasked']:.3f}x)"
    )
    print(f"  planning alone (N={r['sequences']}): {r['plan_ms']:.3f} ms")
    print(f"packed grpo loss balanced / token-mean = {r['ratio_grpo_loss']:.3f} x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
