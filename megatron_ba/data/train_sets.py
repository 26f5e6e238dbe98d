"""Training sets of the paper: DAPO-Math-17k and Polaris-53K.

    from megatron_ba.data import load_dapo_math, load_polaris
    dapo = load_dapo_math()                        # hub; or load_dapo_math("dapo.parquet")
    print(dapo.report.summary())                   # 1791700 rows read, 17398 kept (duplicate..)
    polaris = load_polaris("polaris.jsonl", drop_solved=True)

DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): `prompt` is a list of chat messages whose user
turn is the question inside DAPO's "Answer:" template, `reward_model.ground_truth` the answer.
The file repeats each prompt ~100 times: rows are deduplicated by prompt text (the report counts
the duplicates). Some prompts appear with different ground truths; they are counted apart
(`report.conflicts`, and a note in `report.summary()`) and dropped, or with
on_conflict="keep_first" kept with the truth of their first row. Problem.question is the bare
question; templates.render_prompt(q, "dapo") gives the original prompt back exactly.

Polaris-53K (POLARIS-Project/Polaris-Dataset-53K): `problem`, `answer`, `difficulty` = "k/n",
the pass rate of a reference model over n samples. Polaris drops the problems the reference
model always solves (n/n); `drop_solved=True` does that, `pass_rate_range` is the general form.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_ba.data.records import LoadedSet, LoadReport, Problem, SchemaError
from megatron_ba.data.sources import iter_rows, open_table, require_columns
from megatron_ba.data.templates import strip_dapo_template

DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
POLARIS_HUB_ID = "POLARIS-Project/Polaris-Dataset-53K"
logger = logging.getLogger(__name__)


def _user_text(prompt, row: int, name: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [
            m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"
        ]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise SchemaError(f"{name}: row {row}: 'prompt' must be chat messages with a user turn")


CONFLICT_POLICIES = ("drop", "keep_first")


def load_dapo_math(
    source: str | Path = DAPO_HUB_ID,
    *,
    split: str = "train",
    dedupe: bool = True,
    on_conflict: str = "drop",
) -> LoadedSet:
    """DAPO-Math-17k as math Problems (deduplicated by prompt text unless dedupe=False).

    on_conflict: what to do with a prompt that appears with different ground truths (the file
    holds such prompts): "drop" (the default) drops every row of it, since no truth can be
    trusted; "keep_first" keeps the rows whose truth is that of the prompt's first row. Either
    way the report counts them apart from plain duplicates and its summary names the policy.
    """
    if on_conflict not in CONFLICT_POLICIES:
        raise ValueError(f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}")
    name = "DAPO-Math-17k"
    table = open_table(source, split=split)
    require_columns(table, ["prompt", "reward_model", "reward_model.ground_truth"], name=name)
    has_index = "extra_info" in table.features
    report = LoadReport(name, str(source))
    rows = []  # (prompt, truth, id) of the rows kept by the first pass (not 1.8M row objects)
    first_truth: dict[str, str] = {}  # prompt -> the ground truth of its first row
    truths: dict[str, set[str]] = {}  # prompt -> every ground truth it appears with
    repeats: dict[str, int] = {}  # prompt -> rows that repeat its first (prompt, truth)
    cols = ["prompt", "reward_model"] + (["extra_info"] if has_index else [])
    for i, row in enumerate(iter_rows(table, cols)):
        report.rows_read += 1
        text = _user_text(row["prompt"], i, name)
        truth = (row["reward_model"] or {}).get("ground_truth")
        if not isinstance(truth, str) or not truth.strip():
            raise SchemaError(f"{name}: row {i}: reward_model.ground_truth is empty or not text")
        truth = truth.strip()
        if text not in first_truth:
            first_truth[text], truths[text] = truth, {truth}
        else:
            truths[text].add(truth)
            if dedupe and truth == first_truth[text]:
                repeats[text] = repeats.get(text, 0) + 1
                continue
        extra = row.get("extra_info") or {}
        pid = str(extra.get("index", i)) if isinstance(extra, dict) else str(i)
        rows.append((text, truth, pid))
    conflicting = {t for t, ts in truths.items() if len(ts) > 1}
    problems = []
    for text, truth, pid in rows:
        if text in conflicting:
            if on_conflict == "drop":
                report.drop("prompt with conflicting ground truths")
                continue
            if truth != first_truth[text]:
                report.drop("conflicting ground truth (not the first)")
                continue
        problems.append(Problem(pid, strip_dapo_template(text), truth, source="dapo_math"))
    for text, count in repeats.items():
        whole = text in conflicting and on_conflict == "drop"  # its repeats go with it
        report.drop("prompt with conflicting ground truths" if whole else "duplicate prompt", count)
    if conflicting:
        kept = "dropped" if on_conflict == "drop" else "kept with their first ground truth"
        note = (
            f"{len(conflicting)} prompts appear with different ground truths: {kept} "
            f"(on_conflict={on_conflict!r}; the other choice is "
            f"{next(p for p in CONFLICT_POLICIES if p != on_conflict)!r})"
        )
        report.note(note)
        logger.warning("%s: %s", name, note)
    report.conflicts = len(conflicting)
    report.kept = len(problems)
    return LoadedSet(problems, report)


def parse_difficulty(text, row: int = 0, name: str = "Polaris") -> float:
    """'7/8' -> 0.875 (a pass rate); ValueError naming the row otherwise."""
    try:
        k, n = (int(x) for x in str(text).split("/"))
        if n <= 0 or not 0 <= k <= n:
            raise ValueError
    except ValueError:
        msg = f"{name}: row {row}: difficulty must look like 'k/n', got {text!r}"
        raise SchemaError(msg) from None
    return k / n


def load_polaris(
    source: str | Path = POLARIS_HUB_ID,
    *,
    split: str = "train",
    drop_solved: bool = False,
    pass_rate_range: tuple[float, float] | None = None,
) -> LoadedSet:
    """Polaris-53K as math Problems, optionally filtered by the reference pass rate.

    drop_solved: drop problems with pass rate 1 (Polaris' filter of problems that are too easy).
    pass_rate_range: keep only lo <= pass rate <= hi.
    """
    name = "Polaris-53K"
    if pass_rate_range is not None:
        lo, hi = pass_rate_range
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"pass_rate_range must satisfy 0 <= lo <= hi <= 1, got {(lo, hi)}")
    table = open_table(source, split=split)
    require_columns(table, ["problem", "answer", "difficulty"], name=name)
    report = LoadReport(name, str(source))
    problems = []
    for i, row in enumerate(iter_rows(table, ["problem", "answer", "difficulty"])):
        report.rows_read += 1
        rate = parse_difficulty(row["difficulty"], i, name)
        if drop_solved and rate == 1.0:
            report.drop("solved by the reference model")
            continue
        if pass_rate_range is not None and not pass_rate_range[0] <= rate <= pass_rate_range[1]:
            report.drop("pass rate out of range")
            continue
        answer = str(row["answer"]).strip() if row["answer"] is not None else ""
        if not answer or not str(row["problem"] or "").strip():
            report.drop("empty problem or answer")
            continue
        problems.append(
            Problem(str(i), str(row["problem"]), answer, source="polaris", meta={"pass_rate": rate})
        )
    report.kept = len(problems)
    return LoadedSet(problems, report)
