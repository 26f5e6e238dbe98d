"""A built-in sampler: plain autoregressive sampling through the policy itself (no vLLM)."""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_ba.generation.engine import Sample
from megatron_ba.megatron.batching import causal_mask


class BuiltinSampler:  # an Engine (generation.engine)
    """Plain autoregressive sampling through the policy itself, no KV cache (slow; explicit only).

    `forward(tokens, position_ids, attention_mask) -> logits [B, S, V]` on the full vocabulary,
    with megatron-core's mask convention (True = masked out). Rows are batched by prompt length,
    so no row is ever padded: every forward is a plain causal one over real tokens. Padding
    before a prompt would be hidden from attention by the mask, but not from a Gated DeltaNet
    layer (Qwen3.5), whose causal conv1d and recurrent state read every position and ignore the
    mask (megatron-core's GatedDeltaNet: "TODO: Deal with attention_mask"): its pad tokens would
    enter the prompt's state (tests/test_qwen3_5_training.py shows both). Rows that have sampled
    EOS leave the batch. Each row draws its sampling noise from one [rows, max_tokens] table of
    the seeded generator, so a row's sample does not depend on which rows share its batch.
    Used when vLLM is not installed or cannot serve the model and the recipe asks for
    `rollout.engine: builtin`; its throughput against vLLM is in docs/performance.md.
    """

    def __init__(self, forward, *, eos_token_id: int, pad_token_id: int, decode) -> None:
        self.forward = forward
        self.eos = eos_token_id
        self.pad = pad_token_id  # no row is padded; kept for the Engine's constructor contract
        self.decode = decode

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
        first_index: int = 0,
    ) -> list[list[Sample]]:
        """n samples per prompt, in prompt order, from one generator seeded with `seed` (the
        sampler serves a world of one: it always gets the whole batch, `first_index` 0)."""
        if first_index != 0:
            raise ValueError(
                f"first_index: the built-in sampler takes whole batches, got {first_index}"
            )
        rows = [p for p in prompt_ids for _ in range(n)]
        g = torch.Generator().manual_seed(seed)
        # One uniform per (row, step), drawn before any forward: the inverse-CDF draw of row i's
        # t-th token reads noise[i, t] whatever the grouping and whichever rows are still live.
        noise = torch.rand((len(rows), max(max_tokens, 1)), generator=g, dtype=torch.float64)
        out: list[list[int]] = [[] for _ in rows]
        out_logp: list[list[float]] = [[] for _ in rows]
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(rows):
            by_length[len(p)].append(i)
        for members in by_length.values():
            self._sample_group(rows, members, noise, temperature, max_tokens, out, out_logp)
        samples = []
        for ids, logps in zip(out, out_logp, strict=True):
            finished = bool(ids) and ids[-1] == self.eos
            text_ids = ids[:-1] if finished else ids
            samples.append(Sample(ids, self.decode(text_ids), finished, logps))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _sample_group(self, rows, members, noise, temperature, max_tokens, out, out_logp) -> None:
        """Sample rows `members` (prompts of one length) into out / out_logp, dropping each row
        from the batch once it has sampled EOS."""
        live = torch.tensor(members, dtype=torch.long)
        tokens = torch.tensor([rows[i] for i in members], dtype=torch.long)
        for t in range(max_tokens):
            b, s = tokens.shape
            logits = self.forward(tokens, torch.arange(s).expand(b, s), causal_mask(s))
            logits = logits[:, -1].double() / temperature
            probs = torch.softmax(logits, dim=-1)
            cdf = probs.cumsum(dim=-1)
            # right=True: the first token whose cdf exceeds u, never one of probability 0
            u = noise[live, t][:, None] * cdf[:, -1:]  # scaled: the last entry is 1 to rounding
            nxt = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)
            logp = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)
            for j, i in enumerate(live.tolist()):
                out[i].append(int(nxt[j]))
                out_logp[i].append(float(logp[j]))
            keep = nxt != self.eos
            if not bool(keep.any()):
                return
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)[keep]
            live = live[keep]

    def close(self) -> None:
        """Nothing to free: the policy is the trainer's."""
