"""A synthetic verifiable math task for CPU runs: chains of single-digit additions/subtractions.

    prompt    "3+5-2+3="
    correct   "3+5=8, 8-2=6, 6+3=9. Answer: 9"
    sloppy    "3+5=8, so 8. 8-2=5, so 5. 5+3=8, so 8. Answer: 8"   (restates, slips once)

Every running value stays a single digit (0..9), so each step is one of ~100 table facts a tiny
model learns in a short warm start; difficulty and length come from the number of terms.
Worked solutions grow with the number of terms (2..max_terms), so lengths vary within a group.
The warm start trains on a mixture of correct and sloppy solutions: the sloppy ones are longer
and wrong, so the warm-started policy is right part of the time and its wrong answers tend to be
longer — the regime where token aggregation's sign-length coupling shows (docs/math.md, sec. 2).

Everything is a deterministic function of the seed: the train/eval split is by expression hash,
so no evaluation prompt is ever trained on.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from functools import cached_property

# Above this many expressions the held-out split (about eval_fraction of them) is far larger than
# any evaluation asks for, so it is not enumerated.
_ENUMERATED_EXPRESSIONS = 200_000

MAX_RESTATES = 4  # a sloppy solution of 9 terms then still fits the tiny model's context


def _evaluate(terms: list[int], ops: list[str]) -> list[int]:
    """Running values after each operation."""
    values, acc = [], terms[0]
    for op, t in zip(ops, terms[1:], strict=True):
        acc = acc + t if op == "+" else acc - t
        values.append(acc)
    return values


def _parse(prompt: str) -> tuple[list[int], list[str]]:
    expr = prompt.rstrip("=")
    terms, ops = [int(expr[0])], []
    for i in range(1, len(expr), 2):
        ops.append(expr[i])
        terms.append(int(expr[i + 1]))
    return terms, ops


def answer_of(prompt: str) -> int:
    terms, ops = _parse(prompt)
    return _evaluate(terms, ops)[-1]


def correct_solution(prompt: str) -> str:
    terms, ops = _parse(prompt)
    values = _evaluate(terms, ops)
    steps, prev = [], terms[0]
    for op, t, v in zip(ops, terms[1:], values, strict=True):
        steps.append(f"{prev}{op}{t}={v}")
        prev = v
    return f"{', '.join(steps)}. Answer: {values[-1]}"


def sloppy_solution(prompt: str, rng: random.Random, restates: int = 1) -> str:
    """Slips by one at a random step (always wrong), restating each running value `restates` times.

    restates=0 writes the correct solution's format, so a wrong answer is exactly as long as a
    right one; each restatement adds ", so v" to every step, which makes wrong answers longer.
    """
    terms, ops = _parse(prompt)
    slip_at = rng.randrange(len(ops))
    steps, prev = [], terms[0]
    for k, (op, t) in enumerate(zip(ops, terms[1:], strict=True)):
        v = prev + t if op == "+" else prev - t
        if k == slip_at:  # off by one, staying a digit
            v = v + 1 if v == 0 or (v < 9 and rng.random() < 0.5) else v - 1
        steps.append(f"{prev}{op}{t}={v}" + f", so {v}" * restates)
        prev = v
    if restates == 0:
        return f"{', '.join(steps)}. Answer: {prev}"
    return f"{'. '.join(steps)}. Answer: {prev}"


@dataclass(frozen=True)
class ArithmeticTask:
    min_terms: int = 2
    max_terms: int = 5
    seed: int = 1234
    eval_fraction: float = 0.1  # share of the expression space held out for evaluation
    restates: int = 1  # the sloppy style's restatements per step: the wrong-right length gap

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= 9:
            raise ValueError(
                f"min_terms, max_terms: need 2 <= min_terms <= max_terms <= 9, got "
                f"{self.min_terms}, {self.max_terms}"
            )
        if not 0 <= self.restates <= MAX_RESTATES:
            raise ValueError(
                f"data.sloppy_restates: need 0 <= sloppy_restates <= {MAX_RESTATES}, "
                f"got {self.restates}"
            )

    def _is_eval(self, prompt: str) -> bool:
        h = hashlib.sha256(f"{self.seed}:{prompt}".encode()).digest()
        return int.from_bytes(h[:4], "big") / 2**32 < self.eval_fraction

    def _expressions(self, terms: int):
        """Every prompt of `terms` terms whose running values stay digits (10 * 11**(terms-1))."""
        for first in range(10):
            for moves in itertools.product(range(11), repeat=terms - 1):
                acc, parts = first, [str(first)]
                for m in moves:  # from acc there are 10 - acc additions and acc + 1 subtractions
                    op, t = ("+", m) if m < 10 - acc else ("-", m - (10 - acc))
                    acc = acc + t if op == "+" else acc - t
                    parts += [op, str(t)]
                yield "".join(parts) + "="

    @cached_property
    def eval_split_size(self) -> int | None:
        """How many distinct held-out prompts exist; None when too many to count (ample)."""
        sizes = range(self.min_terms, self.max_terms + 1)
        if sum(10 * 11 ** (n - 1) for n in sizes) > _ENUMERATED_EXPRESSIONS:
            return None
        return sum(self._is_eval(p) for n in sizes for p in self._expressions(n))

    def _random_prompt(self, rng: random.Random) -> str:
        n = rng.randint(self.min_terms, self.max_terms)
        acc = rng.randint(0, 9)
        parts = [str(acc)]
        for _ in range(n - 1):
            op = rng.choice("+-")
            t = rng.randint(0, 9 - acc) if op == "+" else rng.randint(0, acc)
            acc = acc + t if op == "+" else acc - t
            parts += [op, str(t)]
        return "".join(parts) + "="

    def prompts(self, split: str, count: int, *, offset: int = 0) -> list[str]:
        """`count` prompts of `split` ("train" or "eval"), the same for the same seed.

        Train prompts form one endless deterministic stream: `offset` skips the first ones (the
        data position a resumed run continues from). Eval prompts are distinct.
        """
        if split not in ("train", "eval"):
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        available = self.eval_split_size if split == "eval" else None
        if available is not None and count > available:
            # Distinct prompts are drawn until `count` are found: asking for more than exist
            # would never end.
            raise ValueError(
                f"data.eval_prompts: {count} held-out prompts asked for, but expressions of "
                f"{self.min_terms}..{self.max_terms} terms have only {available}; ask for at most "
                f"{available} or raise data.max_terms"
            )
        rng = random.Random(f"{self.seed}:{split}")
        out: list[str] = []
        seen: set[str] = set()
        skipped = 0
        while len(out) < count:
            p = self._random_prompt(rng)
            if self._is_eval(p) != (split == "eval"):
                continue
            if split == "eval":
                if p in seen:
                    continue
                seen.add(p)
            if skipped < offset:
                skipped += 1
                continue
            out.append(p)
        return out

    def answer(self, prompt: str) -> str:
        """The ground truth the math reward compares a response's final answer with."""
        return str(answer_of(prompt))

    def warmstart_examples(self, count: int, correct_fraction: float) -> list[tuple[str, str]]:
        """(prompt, response) pairs: `correct_fraction` correct, the rest sloppy (and wrong)."""
        rng = random.Random(f"{self.seed}:warmstart")
        prompts = self.prompts("train", count)
        return [
            (
                p,
                correct_solution(p)
                if rng.random() < correct_fraction
                else sloppy_solution(p, rng, self.restates),
            )
            for p in prompts
        ]

    def corpus(self, count: int = 2000) -> list[str]:
        """Text to train the tokenizer on: prompts with both kinds of solution."""
        rng = random.Random(f"{self.seed}:corpus")
        texts = []
        for p in self.prompts("train", count):
            texts += [p + correct_solution(p), p + sloppy_solution(p, rng, self.restates)]
        return texts
