"""`megatron-ba weights`: the per-sequence weights of every rule for one GRPO batch, side by side
(each rule's plan: megatron_ba.loss.LossPlan). `megatron-ba plan`, its former name, still runs it.

    megatron-ba weights                                # a synthetic batch, wrong answers longer
    megatron-ba weights --lengths 4,6,2,8 --rewards 1,0,1,0 --groups 0,0,0,0
    megatron-ba weights --scope batch --neutral-eps 0.1

Shows how token aggregation shifts objective weight towards the longer sign while sequence and
balanced aggregation give each sign its sequence share (the paper's sign-length coupling).
"""

from __future__ import annotations

import argparse

from megatron_ba.errors import UserError
from megatron_ba.loss_settings import RULES, SCOPES


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=_ints, help="comma-separated response lengths T_i")
    p.add_argument("--rewards", type=_floats, help="comma-separated rewards r_i")
    p.add_argument("--groups", type=_ints, help="comma-separated group ids")
    p.add_argument("--scope", choices=SCOPES, default="group")
    p.add_argument("--neutral-eps", type=float, default=0.0)
    p.add_argument("--max-length", type=int, default=None, help="dr_grpo's budget (default max T)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")


def synthetic_batch(seed: int, groups: int = 2, group_size: int = 4):
    """Binary rewards; wrong answers about twice as long as right ones."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(groups * group_size, generator=g) < 0.5).double()
    rewards[::group_size] = 1.0  # every group has both signs
    rewards[1::group_size] = 0.0
    base = torch.randint(3, 9, (groups * group_size,), generator=g)
    lengths = torch.where(rewards > 0, base, 2 * base)
    ids = torch.arange(groups).repeat_interleave(group_size)
    return lengths, rewards, ids


def _batch(args: argparse.Namespace):
    """(lengths, rewards, group ids) from the options, or the synthetic batch."""
    import torch

    given = {"--lengths": args.lengths, "--rewards": args.rewards, "--groups": args.groups}
    if all(v is None for v in given.values()):
        lengths, rewards, ids = synthetic_batch(args.seed)
        return lengths.double(), rewards, ids
    if any(v is None for v in given.values()):
        raise UserError("weights: give --lengths, --rewards and --groups together")
    if len({len(v) for v in given.values()}) != 1:
        counts = ", ".join(f"{k} {len(v)}" for k, v in given.items())
        raise UserError(
            f"weights: --lengths, --rewards and --groups need one entry each per "
            f"sequence, got {counts}"
        )
    return (
        torch.tensor(args.lengths, dtype=torch.float64),
        torch.tensor(args.rewards, dtype=torch.float64),
        torch.tensor(args.groups),
    )


def run(args: argparse.Namespace) -> int:
    # torch: imported on use, so that --help imports none
    from megatron_ba.advantages import group_advantages
    from megatron_ba.aggregation import sequence_weights
    from megatron_ba.diagnostics import batch_diagnostics

    lengths, rewards, ids = _batch(args)
    adv = group_advantages(rewards, ids).advantages
    max_length = args.max_length or int(lengths.max())
    weights = {
        r: sequence_weights(
            r,
            lengths,
            adv,
            ids,
            scope=args.scope,
            max_length=max_length,
            neutral_eps=args.neutral_eps,
        )
        for r in RULES
    }
    width = max(13, *(len(r) for r in RULES))  # every rule's name fits its column
    head = f"{'i':>3} {'group':>5} {'T':>5} {'reward':>6} {'A':>8} " + " ".join(
        f"{r:>{width}}" for r in RULES
    )
    print(head)
    for i in range(lengths.numel()):
        cells = " ".join(f"{float(weights[r][i]):{width}.6f}" for r in RULES)
        print(
            f"{i:>3} {int(ids[i]):>5} {int(lengths[i]):>5} {float(rewards[i]):>6.2f} "
            f"{float(adv[i]):>8.4f} {cells}"
        )
    d = batch_diagnostics(lengths, adv, ids, scope=args.scope, neutral_eps=args.neutral_eps)
    print()
    print(
        f"mean length +: {d['length_mean_pos']:.2f}  -: {d['length_mean_neg']:.2f}  "
        f"gap: {d['length_gap_pos_minus_neg']:+.2f}  length var: {d['length_var']:.2f}"
    )
    for r in ("token", "sequence", "balanced"):
        print(
            f"{r:>9}: positive share of objective weight {d[f'{r}/weight_share_pos']:.4f}, "
            f"PG objective at rho=1 {d[f'{r}/objective_at_rho1']:+.6f}"
        )
    return 0
