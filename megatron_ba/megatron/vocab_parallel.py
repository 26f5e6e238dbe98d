"""Token log-probs and entropy from tensor-parallel (vocab-sharded) logits, optionally chunked.

Each TP rank holds a slice [r * V/TP, (r+1) * V/TP) of the vocabulary (megatron-core's
VocabUtility convention). With x = logits / temperature (in fp32, as vLLM's sampler divides the
fp32 logits by the temperature before the softmax) and t the target id:

    logprob = x_t - lse,        lse = log sum_j exp(x_j)        (sum over the whole vocabulary)
    entropy = -sum_j p_j log p_j,                               p_j = exp(x_j - lse)

Two implementations with the same results, chosen by `chunk_size`:

* `chunk_size=None`: plain torch autograd over the whole shard, with two all-reduces (max, then
  one SUM of [sum exp, target logit, sum p x]). The SUM's backward is the identity, as every TP
  rank computes the same loss from the replicated results (megatron-core's "reduce from TP
  region"). Memory: several fp32 [T, V/TP] tensors saved for backward, like a naive loss.
* `chunk_size=C`: an autograd.Function that walks the tokens C at a time and keeps, per token,
  only the shard-local statistics (local lse, local entropy, target logit). One all-gather of
  those (3 x T floats per rank) combines them exactly:

      w_r = exp(lse_r - lse),  lse = logsumexp_r lse_r,  entropy = sum_r w_r h_r - w_r log w_r

  (the chain rule of entropy: which shard, then which token inside it). It saves only its inputs
  and O(T) statistics, and its backward recomputes each chunk's softmax to write the gradient

      d/dx_j = g_lp (1[j = t] - p_j) - g_H p_j (log p_j + entropy)

  which needs no collective: p_j, lse and the entropy are already global. Peak extra memory is
  O(C x V/TP) fp32 (two chunk buffers) plus the gradient itself, in the logits' dtype.

Gradients assume what megatron-core's tensor-parallel losses assume: every TP rank back-propagates
the same upstream gradient (the loss is computed identically on each rank). Under that, the
gradient each rank gets for its shard is exactly the full-vocabulary gradient's slice.

The caller's logits are never modified. Logits must be finite: the per-token results are checked
(O(T), no extra pass over the logits) and a NaN/inf result raises ValueError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs"]


# --- collectives --------------------------------------------------------------------------------
# The only three collectives of this module, kept together (see the report on moving them to
# megatron_ba/parallel/collectives.py once that module exists).


def _tp_rank_and_size(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _all_reduce_max_(t: torch.Tensor, tp_group) -> torch.Tensor:
    """In place on a tensor this module owns; no gradient (a softmax is shift-invariant)."""
    if tp_group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tp_group)
    return t


class _SumOverTP(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: the loss downstream is replicated over TP ranks,
    so d loss / d (this rank's summand) = d loss / d (the sum), which each rank already has."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, tp_group) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=tp_group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _all_gather_stats(stats: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """[k, T] per rank -> [TP, k, T], rank r's statistics in row r."""
    if tp_group is None:
        return stats.unsqueeze(0)
    parts = [torch.empty_like(stats) for _ in range(tp_size)]
    dist.all_gather(parts, stats.contiguous(), group=tp_group)
    return torch.stack(parts)


# --- input checks -------------------------------------------------------------------------------


def _check_inputs(logits, targets, temperature, chunk_size, vocab_size: int) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        kind = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: must be a floating-point tensor, got {kind}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: need a last (vocab shard) dim of size >= 1, got {logits.shape}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        kind = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets: must be an integer tensor of token ids, got {kind}")
    if targets.dtype == torch.bool:
        raise ValueError("targets: must be an integer tensor of token ids, got torch.bool")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} must equal logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}"
        )
    if targets.numel() > 0:
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"targets: ids must lie in [0, {vocab_size}) (V/TP = {logits.shape[-1]} x TP), "
                f"got min {lo}, max {hi}"
            )
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature: must be a number > 0, got {temperature!r}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
    ):
        raise ValueError(f"chunk_size: must be a positive int or None, got {chunk_size!r}")


def _check_finite(lse: torch.Tensor, *results: torch.Tensor) -> None:
    for name, t in (("log-normaliser", lse), *(("result", r) for r in results)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"logits: must be finite; the {name} of {int((~torch.isfinite(t)).sum())} "
                "token(s) is NaN/inf (NaN or +-inf logits, or a target whose logit is -inf)"
            )


# --- the unchunked path: autograd through explicit collectives ----------------------------------


def _unchunked(x, local_t, in_shard, temperature, tp_group, with_entropy):
    x = x.float() / temperature  # new fp32 tensor (also when x is fp32): the input stays intact
    m = _all_reduce_max_(x.detach().amax(dim=-1, keepdim=True), tp_group)
    xm = x - m
    e = xm.exp()
    z = torch.where(in_shard, xm.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), 0.0)
    parts = [e.sum(-1), z] + ([(e * xm).sum(-1)] if with_entropy else [])
    stacked = torch.stack(parts)
    if tp_group is not None:
        stacked = _SumOverTP.apply(stacked, tp_group)
    s, z = stacked[0], stacked[1]
    log_s = s.log()
    logprobs = z - log_s
    if not with_entropy:
        _check_finite(log_s + m.squeeze(-1), logprobs)
        return logprobs, None
    entropy = log_s - stacked[2] / s
    _check_finite(log_s + m.squeeze(-1), logprobs, entropy)
    return logprobs, entropy


# --- the chunked path: O(T) statistics forward, recompute in backward ---------------------------


def _load_chunk(buf: torch.Tensor, src: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 copy of a chunk of logits, divided by the temperature, in a reused buffer."""
    x = buf[: src.shape[0]]
    x.copy_(src)
    if temperature != 1.0:
        x.div_(temperature)
    return x


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, local_t, in_shard, temperature, chunk, with_entropy, tp_group):
        n, v_local = logits2d.shape
        rank_stats = torch.zeros(3, n, dtype=torch.float32, device=logits2d.device)
        lse_r, h_r, z_r = rank_stats.unbind(0)  # local lse, local entropy, target logit (or 0)
        c = max(1, min(chunk, n))
        xbuf = torch.empty(c, v_local, dtype=torch.float32, device=logits2d.device)
        ebuf = torch.empty_like(xbuf) if with_entropy else None
        for a in range(0, n, c):
            b = min(a + c, n)
            x = _load_chunk(xbuf, logits2d[a:b], temperature)
            rows = in_shard[a:b]
            z_r[a:b] = torch.where(rows, x.gather(1, local_t[a:b, None]).squeeze(1), 0.0)
            m = x.amax(dim=1)
            x.sub_(m[:, None])
            if with_entropy:
                e = torch.exp(x, out=ebuf[: b - a])
                s = e.sum(dim=1)
                # sum_j e_j (x_j - m) as a batched dot product: no [chunk, V/TP] temporary
                ex = torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1)
                h_r[a:b] = s.log() - ex / s
            else:
                s = x.exp_().sum(dim=1)
            lse_r[a:b] = m + s.log()

        tp_size = _tp_rank_and_size(tp_group)[1]
        gathered = _all_gather_stats(rank_stats, tp_group, tp_size)  # [TP, 3, n]
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        logprobs = gathered[:, 2].sum(0) - lse
        if with_entropy:
            w = torch.exp(gathered[:, 0] - lse)
            entropy = (w * gathered[:, 1] + torch.special.entr(w)).sum(0)
            _check_finite(lse, logprobs, entropy)
        else:
            entropy = None
            _check_finite(lse, logprobs)

        ctx.save_for_backward(logits2d, local_t, in_shard, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, c
        ctx.set_materialize_grads(False)
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_h=None):
        logits2d, local_t, in_shard, lse, entropy = ctx.saved_tensors
        if g_lp is None and g_h is None:
            return (None,) * 7
        tau, c = ctx.temperature, ctx.chunk
        n, v_local = logits2d.shape
        # d/d logits = (1 / temperature) d/dx: fold the factor into the upstream gradients.
        g_lp = None if g_lp is None else g_lp.float() / tau
        g_h = None if (g_h is None or entropy is None) else g_h.float() / tau
        grad = torch.empty_like(logits2d, memory_format=torch.contiguous_format)
        xbuf = torch.empty(c, v_local, dtype=torch.float32, device=logits2d.device)
        pbuf = torch.empty_like(xbuf) if g_h is not None else None
        for a in range(0, n, c):
            b = min(a + c, n)
            y = _load_chunk(xbuf, logits2d[a:b], tau)
            y.sub_(lse[a:b, None])  # log p
            if g_h is not None:
                p = torch.exp(y, out=pbuf[: b - a])
                # -p * (g_lp + g_h (log p + H)), built in place in y
                y.add_(entropy[a:b, None]).mul_(g_h[a:b, None])
                if g_lp is not None:
                    y.add_(g_lp[a:b, None])
                y.mul_(p).neg_()
            else:
                y.exp_().mul_(-g_lp[a:b, None])
            if g_lp is not None:
                rows = in_shard[a:b].nonzero().squeeze(1)
                y[rows, local_t[a + rows]] += g_lp[a + rows]
            grad[a:b].copy_(y)
        return grad, None, None, None, None, None, None


# --- public entry point -------------------------------------------------------------------------


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` (and the entropy) under softmax(logits / temperature).

    logits: [..., V/TP], this rank's vocabulary shard, any float dtype (computed in fp32).
    targets: [...], global token ids (the same on every TP rank).
    tp_group: the process group of the TP ranks; None means the logits hold the whole vocabulary.
    chunk_size: tokens per chunk over the flattened leading dims (None: one pass, no recompute).
    Returns fp32 logprobs [...] (and fp32 entropy [...] when with_entropy), differentiable
    w.r.t. logits; every TP rank must call this with the same shapes, targets and options.
    """
    tp_rank, tp_size = _tp_rank_and_size(tp_group)
    v_local = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() else 0
    _check_inputs(logits, targets, temperature, chunk_size, v_local * tp_size)
    temperature = float(temperature)
    lead = logits.shape[:-1]
    vocab_start = tp_rank * v_local  # megatron-core's VocabUtility: rank r holds [r V/TP, ...)
    local_t = targets.reshape(-1).long() - vocab_start
    in_shard = (local_t >= 0) & (local_t < v_local)
    local_t = local_t.clamp(0, v_local - 1)  # any valid index; rows outside the shard are masked

    logits2d = logits.reshape(-1, v_local)
    if chunk_size is None:
        logprobs, entropy = _unchunked(
            logits2d, local_t, in_shard, temperature, tp_group, with_entropy
        )
    else:
        out = _ChunkedLogprobs.apply(
            logits2d, local_t, in_shard, temperature, chunk_size, with_entropy, tp_group
        )
        logprobs, entropy = out if with_entropy else (out, None)
    if with_entropy:
        return logprobs.view(lead), entropy.view(lead)
    return logprobs.view(lead)
