"""A built-in sampler: plain autoregressive sampling through the policy itself (no vLLM)."""

from __future__ import annotations

import torch

from megatron_ba.generation.engine import Sample
from megatron_ba.megatron.batching import causal_mask


class BuiltinSampler:  # an Engine (generation.engine)
    """Plain autoregressive sampling through the policy itself, no KV cache (slow; explicit only).

    `forward(tokens, position_ids, attention_mask) -> logits [B, S, V]` on the full vocabulary,
    with megatron-core's mask convention (True = masked out). Prompts are left-padded so that
    every row's next token sits in the last column; padding is masked from attention and skipped
    by the position ids. Used when vLLM is not installed and the recipe asks for
    `rollout.engine: builtin`; its throughput against vLLM is in docs/performance.md.
    """

    def __init__(self, forward, *, eos_token_id: int, pad_token_id: int, decode) -> None:
        self.forward = forward
        self.eos = eos_token_id
        self.pad = pad_token_id
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
        g = torch.Generator().manual_seed(seed)
        rows = [p for p in prompt_ids for _ in range(n)]
        width = max(len(p) for p in rows)
        tokens = torch.full((len(rows), width), self.pad, dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, p in enumerate(rows):
            tokens[i, width - len(p) :] = torch.tensor(p)
            valid[i, width - len(p) :] = True
        done = torch.zeros(len(rows), dtype=torch.bool)
        out: list[list[int]] = [[] for _ in rows]
        out_logp: list[list[float]] = [[] for _ in rows]
        for _ in range(max_tokens):
            s = tokens.shape[1]
            positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            mask = causal_mask(s, valid=valid)
            logits = self.forward(tokens, positions, mask)[:, -1].double() / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).squeeze(1)
            logp = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None]).squeeze(1)
            for i in (~done).nonzero().flatten().tolist():
                out[i].append(int(nxt[i]))
                out_logp[i].append(float(logp[i]))
            done |= nxt == self.eos
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            valid = torch.cat([valid, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
            if bool(done.all()):
                break
        samples = []
        for ids, logps in zip(out, out_logp, strict=True):
            finished = bool(ids) and ids[-1] == self.eos
            text_ids = ids[:-1] if finished else ids
            samples.append(Sample(ids, self.decode(text_ids), finished, logps))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def close(self) -> None:
        """Nothing to free: the policy is the trainer's."""
