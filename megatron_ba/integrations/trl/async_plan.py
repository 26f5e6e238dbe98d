"""The data path of `BalancedAsyncGRPOTrainer`: each rollout sample carries its whole group's plan
from where the group is still whole to the packed micro-batch.

TRL's AsyncGRPOTrainer scores a prompt group in its rollout worker (advantages per group, the
population std) and puts the group's samples on a queue; on the main process the trainer reads
them one at a time (dropping those more than `max_staleness` policy versions old), a batcher
forms micro-batches (`TokenBudgetBatcher` may cut a group between two, and so between two
optimiser steps; a step may hold groups of several versions), and a collator packs each into one
row per process. Only the group id, advantage, mask, log-probs and a per-sample `metrics` dict
pass from the queue to the collator.

So the plan is attached at the queue, where the groups are whole (`GroupPlanQueue`): a group's
samples are held until all `num_generations` of them have arrived, then each gets its whole
group's weight w_i^g and share 1/|g| (megatron_ba.step_plan.whole_group_weights) in its `metrics`
dict, before any staleness drop or cut. `PlanCollator` takes them out of `metrics` (so TRL does
not log them) and adds them to the packed batch, per loss term: `ba_weights`, `ba_advantages`
(float64: TRL packs its advantages in float32) and, repeated on every process's row like TRL's
`global_n_tokens`, `ba_group_share`, the sum of the micro-batch's shares. The trainer sums that
over the micro-batches of an optimiser step into Gamma_t.

Every sample of a micro-batch passes through the main process, whatever process trains it, so
the statistics are whole there and no all-reduce is needed (the synchronous TRL trainer sums its
table over processes because there each process scores its own share).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from megatron_ba.step_plan import whole_group_weights

# Keys of a sample's `metrics` dict that carry its plan from the queue to the collator.
WEIGHT_KEY, SHARE_KEY = "ba/whole_group_weight", "ba/group_share"


class GroupPlanQueue:
    """The rollout queue as the trainer reads it (`get`, `qsize`), each sample carrying its whole
    group's plan. A group is released when `group_size` of its samples have arrived: one
    training row per completion, which holds for single-turn rollouts (the trainer refuses
    `tools` and `environment_factory`, whose conversations may fork into several rows)."""

    def __init__(self, inner, *, rule: str, group_size: int, neutral_eps: float = 0.0):
        self.inner, self.rule = inner, rule
        self.group_size, self.neutral_eps = group_size, neutral_eps
        self._pending: dict[int, list] = {}
        self._released: set[int] = set()
        self._ready: deque = deque()

    def get(self, timeout: float | None = None):
        """The next sample of a whole group; raises queue.Empty as the inner queue does when
        none is complete within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._add(self.inner.get(timeout=left))
        return self._ready.popleft()

    def qsize(self) -> int:
        held = sum(len(group) for group in self._pending.values())
        return self.inner.qsize() + held + len(self._ready)

    def _add(self, sample) -> None:
        if sample.group_id in self._released:
            raise ValueError(
                f"rollout sample: group {sample.group_id} sent more than num_generations="
                f"{self.group_size} rows; the plan needs one row per completion"
            )
        group = self._pending.setdefault(sample.group_id, [])
        group.append(sample)
        if len(group) == self.group_size:
            self._released.add(sample.group_id)
            self._release(self._pending.pop(sample.group_id))

    def _release(self, group: list) -> None:
        # The packer trains a row's positions 1.. where its mask is set: T_i counts those.
        lengths = torch.tensor([int(s.completion_mask[1:].sum()) for s in group])
        advantages = torch.tensor([float(s.advantage) for s in group], dtype=torch.float64)
        weights, shares = whole_group_weights(
            self.rule,
            lengths,
            advantages,
            torch.zeros(len(group), dtype=torch.long),
            neutral_eps=self.neutral_eps,
        )
        for sample, w, share in zip(group, weights.tolist(), shares.tolist(), strict=True):
            sample.metrics[WEIGHT_KEY], sample.metrics[SHARE_KEY] = w, share
        self._ready.extend(group)


class PlanCollator:
    """TRL's rollout collator, with each loss term's plan added to the packed batch."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples: list) -> dict:
        (rows,) = examples  # one micro-batch: one TreeRow per process
        plans = [[_take_plan(sample) for sample in row.samples] for row in rows]
        batch = self.collate(examples)
        shape = batch["segment_id"].shape
        weights = torch.zeros(shape, dtype=torch.float64)
        advantages = torch.zeros(shape, dtype=torch.float64)
        for r, plan in enumerate(plans):
            # Packed loss terms name their sample by its index in the row (segment_id); padding
            # has token_index -1 and keeps 0.
            valid = batch["token_index"][r] >= 0
            seg = batch["segment_id"][r][valid]
            per_sample = torch.tensor([(w, a) for w, _, a in plan], dtype=torch.float64)
            weights[r, valid] = per_sample[seg, 0]
            advantages[r, valid] = per_sample[seg, 1]
        share = sum(s for plan in plans for _, s, _ in plan)
        batch["ba_weights"], batch["ba_advantages"] = weights, advantages
        batch["ba_group_share"] = torch.full((len(rows),), float(share), dtype=torch.float64)
        return batch


def _take_plan(sample: dict) -> tuple[float, float, float]:
    """(w_i^g, 1/|g|, A_i) of a sample, removed from its metrics."""
    metrics = sample["metrics"]
    if WEIGHT_KEY not in metrics:
        raise ValueError(
            "rollout sample: has no plan; it must come through GroupPlanQueue (the trainer's "
            "rollout_queue), which attaches each group's plan when the group is whole"
        )
    return metrics.pop(WEIGHT_KEY), metrics.pop(SHARE_KEY), float(sample["advantage"])


def window_group_count(batches: list[dict]) -> float:
    """Gamma_t of an optimiser step: the sum of its micro-batches' group shares (each the same
    on every process's slice, so no collective)."""
    return float(sum(float(b["ba_group_share"][0]) for b in batches))
