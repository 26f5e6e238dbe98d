"""From rollouts to a GRPO batch: rewards, advantages and right-padded token tensors.

One global batch holds P prompt groups of G responses each, group g's responses in rows
g*G .. g*G+G-1. Rows are cut contiguously across data-parallel ranks (a group may span ranks: the
plan's statistics are all-reduced). A response's length T_i counts its generated tokens, EOS
included; responses of dropped zero-variance groups (grpo.drop_zero_variance) keep their rows so
that the batch still divides evenly into micro-batches, but their response mask is emptied, which
makes them padding for every rule (T_i = 0: no weight, counted nowhere). The rollout engine's
log-prob of each response token (`rollout_logprobs`, token-aligned like the trainer's old
log-probs) rides along for the off-policy correction (megatron_ba.rollout_correction), and with
`rollout.routing_replay` the experts the engine routed each fed token to (`routed_experts`),
which the trainer's forwards replay (megatron_ba.megatron.routing_replay).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_ba.advantages import AdvantageReport, group_advantages
from megatron_ba.generation.engine import Sample


@dataclass
class Experience:
    """A global GRPO batch, identical on every rank after the broadcast."""

    tokens: torch.Tensor  # [N, S] long: prompt + response + right padding
    response_mask: torch.Tensor  # [N, S] bool
    lengths: torch.Tensor  # [N] long: response tokens (0 for dropped rows)
    advantages: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] long, in [0, P)
    rewards: torch.Tensor  # [N] float32
    finished: torch.Tensor  # [N] bool: the response ended with EOS
    num_groups: int
    report: dict[str, float]
    # [N, S] float32, token-aligned: the engine's log-prob of each response token (0 elsewhere);
    # None when the engine returned none.
    rollout_logprobs: torch.Tensor | None = None
    # [N, S, L, K] int16, token-aligned: the experts token t of row i was routed to in each of the
    # L MoE layers when the engine fed it (experts 0..K-1 where it was never fed: the last
    # token, padding); None unless every sample carries them (rollout.routing_replay).
    routed_experts: torch.Tensor | None = None

    def to(self, device) -> Experience:
        """The same batch with every tensor on `device` (the rank's `DistContext.device`): the
        step's inputs, so that every tensor of the step follows them there."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def rows(self, dp: int, dp_rank: int, *, mini_batches: int = 1, index: int = 0) -> torch.Tensor:
        """Row indices of mini-batch `index` (whole groups) on data-parallel rank `dp_rank`."""
        n = self.tokens.shape[0]
        if self.num_groups % mini_batches:
            raise ValueError(
                f"grpo.mini_batches: {mini_batches} must divide the {self.num_groups} prompt "
                f"groups of a step"
            )
        per_mini = n // mini_batches
        if per_mini % dp:
            raise ValueError(
                f"grpo: {per_mini} sequences per mini-batch do not split over {dp} "
                f"data-parallel ranks"
            )
        per_rank = per_mini // dp
        start = index * per_mini + dp_rank * per_rank
        return torch.arange(start, start + per_rank, device=self.tokens.device)


def build_experience(
    prompt_ids: list[list[int]],
    samples: list[list[Sample]],
    rewards: list[float],
    *,
    pad_id: int,
    normalize_std: bool = True,
    std: str = "population",
    drop_zero_variance: bool = False,
    multiple_of: int = 1,
) -> Experience:
    """Tensors of one global batch; `rewards` in sample order (group-major)."""
    G = len(samples[0])
    if any(len(s) != G for s in samples):
        raise ValueError("samples: every prompt needs the same number of responses")
    rows = [(p, s) for p, group in zip(prompt_ids, samples, strict=True) for s in group]
    if len(rewards) != len(rows):
        raise ValueError(f"rewards: expected {len(rows)}, got {len(rewards)}")
    width = max(len(p) + len(s.token_ids) for p, s in rows)
    width += -width % multiple_of
    n = len(rows)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, s) in enumerate(rows):
        seq = p + s.token_ids
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, len(p) : len(seq)] = True
    group_ids = torch.arange(len(prompt_ids)).repeat_interleave(G)
    r = torch.tensor(rewards, dtype=torch.float64)
    adv: AdvantageReport = group_advantages(
        r, group_ids, normalize_std=normalize_std, std=std, drop_zero_variance=drop_zero_variance
    )
    mask &= adv.keep[:, None]
    return Experience(
        rollout_logprobs=_rollout_logprobs(rows, width),
        routed_experts=_routed_experts(rows, width),
        tokens=tokens,
        response_mask=mask,
        lengths=mask.sum(dim=1),
        advantages=adv.advantages.float(),
        group_ids=group_ids,
        rewards=r.float(),
        finished=torch.tensor([s.finished for _, s in rows]),
        num_groups=len(prompt_ids),
        report=adv.metrics(),
    )


def _rollout_logprobs(rows, width: int) -> torch.Tensor | None:
    """[N, width] token-aligned engine log-probs of the responses (0 on prompts and padding),
    or None unless every sample carries one per token."""
    if any(s.logprobs is None or len(s.logprobs) != len(s.token_ids) for _, s in rows):
        return None
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (p, s) in enumerate(rows):
        out[i, len(p) : len(p) + len(s.token_ids)] = torch.tensor(s.logprobs, dtype=torch.float32)
    return out


def _routed_experts(rows, width: int) -> torch.Tensor | None:
    """[N, width, L, K] token-aligned experts of the fed tokens (Sample.routed_experts: the
    prompt's and the response's but its last), experts 0..K-1 elsewhere; None unless every
    sample carries len(prompt) + len(response) - 1 of them."""
    if any(s.routed_experts is None for _, s in rows):
        return None
    first = torch.as_tensor(rows[0][1].routed_experts)
    layers, k = first.shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), width, layers, k).clone()
    for i, (p, s) in enumerate(rows):
        e = torch.as_tensor(s.routed_experts)
        fed = len(p) + len(s.token_ids) - 1
        if tuple(e.shape) != (fed, layers, k):
            raise ValueError(
                f"routed_experts: sample {i} holds {tuple(e.shape)}, expected {(fed, layers, k)} "
                "(prompt + response but the last token, MoE layers, top-k)"
            )
        out[i, :fed] = e.to(torch.int16)
    return out
