"""The GRPO loss as first written, kept as the reference the folded `grpo_loss` is checked against.

Per token: phi = min(rho A, clip(rho) A) (dual clip: max(phi, c A) where A < 0), then the plan's
weight w_i multiplied into every token of sequence i: loss = -sum_i w_i sum_t phi + kl_coef
sum_i v_i sum_t k3 - entropy_coef sum_i v_i sum_t H. Padded [N, T] tensors with a bool mask only;
float64 in, float64 out. Metrics as the loss defined them (fractions of this part's tokens).
"""

from __future__ import annotations

import torch

from megatron_ba.loss import MAX_LOG_RATIO, GRPOLossConfig


def reference_grpo_loss(logp, old, mask, pg_w, reg_w, adv, cfg=None, ref=None, ent=None):
    cfg = cfg or GRPOLossConfig()
    zero = torch.zeros((), dtype=logp.dtype)
    a = adv.to(logp.dtype)[:, None].expand_as(logp)
    w = pg_w.to(logp.dtype)[:, None].expand_as(logp)
    v = reg_w.to(logp.dtype)[:, None].expand_as(logp)
    log_ratio = torch.where(mask, logp - old, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    phi = torch.minimum(ratio * a, clipped * a)
    dual_active = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * a
        dual_active = mask & (a < 0) & (phi < floor)
        phi = torch.where(a < 0, torch.maximum(phi, floor), phi)
    pg = -torch.where(mask, w * phi, zero).sum()
    loss, m = pg, {"pg_loss": pg.detach()}
    if ref is not None:
        d = torch.where(mask, ref - logp, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = torch.where(mask, v * (d.exp() - d - 1.0), zero).sum()
        m["kl"] = kl.detach()
        loss = loss + cfg.kl_coef * kl
    if ent is not None:
        h = torch.where(mask, v * ent, zero).sum()
        m["entropy"] = h.detach()
        loss = loss - cfg.entropy_coef * h
    n = mask.sum().clamp(min=1).to(logp.dtype)
    ratio = ratio.detach()
    m["clip_low_frac"] = (mask & (a < 0) & (ratio < 1.0 - cfg.clip_low)).sum() / n
    m["clip_high_frac"] = (mask & (a > 0) & (ratio > 1.0 + cfg.clip_high)).sum() / n
    m["dual_clip_frac"] = dual_active.sum() / n
    m["num_tokens_sum"] = mask.sum().to(logp.dtype)
    m["weight_pos_sum"] = torch.where(mask & (a > 0), w, zero).sum()
    m["weight_neg_sum"] = torch.where(mask & (a < 0), w, zero).sum()
    total = m["weight_pos_sum"] + m["weight_neg_sum"]
    m["weight_pos_share"] = m["weight_pos_sum"] / total if total > 0 else zero
    m["ratio_mean"] = torch.where(mask, ratio, zero).sum() / n
    return loss, m
