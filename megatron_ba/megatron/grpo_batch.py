"""A data-parallel rank's share of a GRPO batch (GRPOBatch, token-aligned tensors checked on
the way in) and the row helpers the micro-batching reads it with: shapes, label alignment,
padding, each row's last response token. megatron_ba.megatron.batching lays it out for the
schedules."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOBatch:
    """This data-parallel rank's share of a global GRPO batch.

    tokens: [N, S] prompt + response + right padding. response_mask: [N, S], True where the
    token was generated. old_logprobs / ref_logprobs: [N, S] token-aligned (only masked
    positions are read). advantages, group_ids (global, in [0, num_groups)): [N].
    lengths: [N] whole-sequence response lengths; default (and required value): the mask sums.
    is_weights: [N, S] token-aligned rollout-correction weights c_{i,t} (megatron_ba.
    rollout_correction; only masked positions are read), None: no correction.
    routed_experts: [N, S, L, K] token-aligned experts the rollout engine routed each token to
    (L MoE layers, top K), replayed by the forwards (megatron_ba.megatron.routing_replay);
    None: the routers choose.
    """

    tokens: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def checked(self) -> GRPOBatch:
        """A copy with bool mask and lengths filled in; ValueError naming what is wrong."""
        n, s = shape2("tokens", self.tokens)
        for name in ("response_mask", "old_logprobs", "ref_logprobs", "is_weights"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n, s):
                raise ValueError(
                    f"{name}: must have the shape of tokens {(n, s)}, got {tuple(t.shape)}"
                )
        r = self.routed_experts
        if r is not None and (r.dim() != 4 or tuple(r.shape[:2]) != (n, s)):
            raise ValueError(
                f"routed_experts: must be [N, S, layers, topk] with N, S = {(n, s)}, got "
                f"{tuple(r.shape)}"
            )
        if bool(self.response_mask[:, 0].any()):
            raise ValueError(
                "response_mask: position 0 cannot be a response token (nothing predicts it)"
            )
        counts = self.response_mask.sum(dim=1)
        lengths = counts if self.lengths is None else self.lengths
        if tuple(lengths.shape) != (n,) or bool((lengths.to(counts.dtype) != counts).any()):
            raise ValueError(
                "lengths: must be the whole-sequence response lengths, one per row and equal to "
                "response_mask.sum(1) (never a context-parallel shard's)"
            )
        for name in ("advantages", "group_ids"):
            if tuple(getattr(self, name).shape) != (n,):
                raise ValueError(
                    f"{name}: must be [N] with N={n}, got {tuple(getattr(self, name).shape)}"
                )
        return GRPOBatch(
            self.tokens,
            self.response_mask.bool(),
            self.advantages,
            self.group_ids,
            self.old_logprobs,
            self.ref_logprobs,
            lengths,
            self.is_weights,
            self.routed_experts,
        )


def shape2(name: str, t: torch.Tensor) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: must be a 2-D [N, S] tensor, got {getattr(t, 'shape', type(t))}")
    return int(t.shape[0]), int(t.shape[1])


def label_aligned(x: torch.Tensor, fill) -> torch.Tensor:
    """Token-aligned [N, S] -> position-aligned: entry p is about token p + 1 (what p predicts)."""
    out = torch.full_like(x, fill)
    out[:, :-1] = x[:, 1:]
    return out


def pad_to(x: torch.Tensor, length: int, fill) -> torch.Tensor:
    if x.shape[1] == length:
        return x
    pad = torch.full((x.shape[0], length - x.shape[1]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def response_end(response_mask: torch.Tensor) -> list[int]:
    """Per row, the tokens the model must see: up to and including its last response token
    (prompt + response; at least 1). Host ints: the layout is planned on the host."""
    s = response_mask.shape[1]
    pos = torch.arange(1, s + 1, device=response_mask.device)
    end = torch.where(response_mask.bool(), pos, torch.zeros_like(pos)).amax(dim=1)
    return [max(1, int(e)) for e in end.cpu()]  # host copy: planning input
