"""Math reward throughput: (response, answer) pairs per second through MathRewardPool.

    megatron-ba perf rewards --pairs 10000 --workers 2 --timeout 5
    python -m megatron_ba.perf.rewards_perf --pairs 2000          # same, without the CLI

Synthetic but realistic pairs (seeded): a few hundred characters of reasoning, then the final
answer as an "Answer:" line or a \\boxed{}, in forms that need math-verify (fractions vs
decimals, \\dfrac, intervals, sets, units) or the normalisation fallback; a share of wrong and
missing answers; and a small share of adversarial answers (towers of powers, huge factorials)
that make sympy slow or hang. Prints pairs/s, the share of hard timeouts, the agreement of the
scores with the labels of the non-adversarial pairs, how busy the pool kept its workers (time
with an answer assigned / (wall x workers)) and the CPU they got (their CPU seconds / (wall x
workers); below the busy share when other work shares the cores: the 1-min load is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from megatron_ba.rewards.math_pool import MathRewardPool

# (gold, an equivalent way of writing it)
EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{3}{4}", "\\dfrac{3}{4}"),
    ("[1, 3)", "[1,3)"),
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}"),
    ("10", "10 \\text{ cm}"),
    ("-7", "-7"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\pi}{3}", "\\pi/3"),
    ("1000", "1,000"),
    ("x^2 + 2x + 1", "(x+1)^2"),
]
ADVERSARIAL = ["9^{9^{9^{9}}}", "(10^{100000000})!", "2^{2^{2^{2^{2^{2}}}}}", "10^{10^{10^{10}}}"]
FILLER = (
    "We first simplify the expression. Substituting the values gives a smaller equation, "
    "and solving it step by step we obtain the candidate. Checking the boundary cases, "
)


def make_pairs(n: int, seed: int, adversarial_share: float) -> list[tuple[str, str, int | None]]:
    """(response, gold, label): label 1/0 for the expected score, None for adversarial."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        reasoning = FILLER * rng.randint(1, 6)
        u = rng.random()
        if u < adversarial_share:
            gold, answer, label = str(rng.randint(1, 999)), rng.choice(ADVERSARIAL), None
        elif u < 0.35:
            gold = str(rng.randint(-999, 999))
            answer, label = gold, 1
        elif u < 0.6:
            gold, answer = rng.choice(EQUIVALENT)
            label = 1
        elif u < 0.92:
            gold = str(rng.randint(1, 999))
            answer, label = str(int(gold) + rng.randint(1, 50)), 0
        else:
            gold, answer, label = str(rng.randint(1, 999)), None, 0
        if answer is None:
            response = reasoning + "I could not finish."
        elif rng.random() < 0.5:
            response = reasoning + f"\nAnswer: {answer}"
        else:
            response = reasoning + f"so the answer is $\\boxed{{{answer}}}$."
        pairs.append((response, gold, label))
    return pairs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ba perf rewards", description=__doc__)
    p.add_argument("--pairs", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=5.0, help="hard seconds per answer")
    p.add_argument("--adversarial-share", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    load_before = os.getloadavg()[0]
    pairs = make_pairs(args.pairs, args.seed, args.adversarial_share)
    with MathRewardPool(workers=args.workers, timeout_s=args.timeout) as pool:
        pool.score(["Answer: 1"] * args.workers, ["1"] * args.workers)  # start the workers
        cpu0 = pool.worker_cpu_seconds()
        started = time.monotonic()
        out = pool.score([p[0] for p in pairs], [p[1] for p in pairs])
        wall = time.monotonic() - started
        cpu = pool.worker_cpu_seconds() - cpu0
    labelled = [(s, p[2]) for s, p in zip(out.scores, pairs, strict=True) if p[2] is not None]
    figures = {
        "pairs": args.pairs,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "timeout_s": args.timeout,
        "wall_s": round(wall, 2),
        "pairs_per_s": round(args.pairs / wall, 1),
        "hard_timeouts": sum(out.timed_out),
        "hard_timeout_share": sum(out.timed_out) / args.pairs,
        "adversarial_pairs": sum(p[2] is None for p in pairs),
        "label_agreement": sum(s == lab for s, lab in labelled) / max(1, len(labelled)),
        # share of the wall time the pool kept an answer in each worker (its own idleness)
        "worker_busy_share": round(out.metrics["math_reward/worker_busy_share"], 3),
        # CPU the workers actually got (below the busy share when other work shares the cores)
        "worker_cpu_utilisation": round(cpu / (wall * args.workers), 3),
        # load-independent cost: worker CPU per pair (what idle cores would divide)
        "worker_cpu_ms_per_pair": round(1000 * cpu / args.pairs, 2),
        # other work on the machine competes for the same cores: record how much there was
        "loadavg_1min_before": round(load_before, 2),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
    }
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
