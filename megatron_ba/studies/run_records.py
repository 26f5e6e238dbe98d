"""A study's runs as numbers: their folders (recipe.yaml, metrics.jsonl[.gz]), the statistics
over seeds (mean and standard deviation, paired 95% intervals) and the per-run diagnostics
(the sign shares each mean gives, the first step's values) that studies/reporting.py tabulates.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from megatron_ba.errors import UserError
from megatron_ba.loss_settings import RULES
from megatron_ba.studies.grid import MANIFEST, Study

# Student's t at 0.975 for 1..30 degrees of freedom (two-sided 95%); the normal value beyond.
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def metrics_file(run: Path) -> Path | None:
    """A run's metrics.jsonl, or metrics.jsonl.gz where a published study ships it compressed."""
    return next((f for f in (run / "metrics.jsonl", run / "metrics.jsonl.gz") if f.is_file()), None)


def read_metrics(run: Path) -> list[dict]:
    """A run's metrics records, one per step; a file cut short (a run killed while writing it,
    a partial copy) is a UserError naming the file and the line."""
    path = metrics_file(run)
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    records.append(_record(path, number, line))
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        kind = path.suffix[1:]
        raise UserError(f"{path}: cut short or not {kind} ({e}); copy it again") from None
    return records


def _record(path: Path, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: line {number} is not a JSON record ({e.msg}): the run was cut off while "
            "writing it? Remove that line, or copy the file again"
        ) from None


def find_runs(folder: Path) -> list[Path]:
    """The study's element folders that have metrics, else every subfolder with a run in it."""
    if (folder / MANIFEST).is_file():
        study = Study.load(folder)
        runs = [study.run_dir(e) for e in study.elements]
    else:
        runs = sorted(p for p in folder.iterdir() if (p / "recipe.yaml").is_file())
    return [r for r in runs if metrics_file(r) and (r / "recipe.yaml").is_file()]


def swept_keys(folder: Path, keys: list[str] | None) -> list[str]:
    if (folder / MANIFEST).is_file():
        return [a.key for a in Study.load(folder).axes]
    return keys or ["loss.rule", "seed"]


def check_one_recipe(recipes: dict[Path, dict], swept: list[str]) -> None:
    """ValueError naming every key other than the swept ones whose value differs between runs."""
    keys = sorted(set().union(*recipes.values()) - set(swept))
    differs = {k: sorted({repr(r.get(k)) for r in recipes.values()}) for k in keys}
    differs = {k: v for k, v in differs.items() if len(v) > 1}
    if differs:
        shown = "; ".join(f"{k}: {', '.join(v)}" for k, v in differs.items())
        raise ValueError(
            f"the runs' recipes differ in keys that are not swept ({shown}); "
            f"report runs of one recipe, swept only in {', '.join(swept)}"
        )


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; NaN for one value)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
    return m, sd


def paired_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences and its two-sided 95% interval (Student's t, n - 1 df)."""
    m, sd = mean_std(diffs)
    if len(diffs) < 2:
        return m, math.nan, math.nan
    t = T975[len(diffs) - 2] if len(diffs) - 1 <= len(T975) else 1.960
    half = t * sd / math.sqrt(len(diffs))
    return m, m - half, m + half


def over_steps(records: list[dict], key: str) -> float:
    xs = [r[key] for r in records if isinstance(r.get(key), int | float) and "pg_loss" in r]
    return sum(xs) / len(xs) if xs else math.nan


def signed_shares(record: dict) -> dict:
    """The positive side's weight share under the pooled token mean, N+ / (N+ + N-), and its
    share of the responses with a sign, k / (k + n), from a step's logged counts and mean
    lengths: the same at any loss.scope of the run (the trainer logs each rule's share at the
    run's own scope)."""
    k, n = record.get("num_pos"), record.get("num_neg")
    if not (isinstance(k, int | float) and isinstance(n, int | float)) or k + n <= 0:
        return {}
    pos = k * record["length_mean_pos"] if k else 0.0
    neg = n * record["length_mean_neg"] if n else 0.0
    return {
        "token_pooled/weight_share_pos": pos / (pos + neg) if pos + neg > 0 else math.nan,
        "count_share_pos": k / (k + n),
    }


SHARES = ("token_pooled/weight_share_pos", "count_share_pos")  # signed_shares' keys


def diagnostics(records: list[dict]) -> dict:
    """One run's diagnostics, averaged over its training steps (those in `records`)."""
    records = [{**r, **signed_shares(r)} if "pg_loss" in r else r for r in records]
    neg, pos = over_steps(records, "length_mean_neg"), over_steps(records, "length_mean_pos")
    return {
        "pg_loss_mean": over_steps(records, "pg_loss"),
        "pg_loss_mean_abs": sum(abs(r["pg_loss"]) for r in records if "pg_loss" in r)
        / max(1, sum("pg_loss" in r for r in records)),
        "neg_over_pos_length": neg / pos if pos else math.nan,
        **{
            f"{rule}/weight_share_pos": over_steps(records, f"{rule}/weight_share_pos")
            for rule in RULES
        },
        **{k: over_steps(records, k) for k in SHARES},
        "length_var": over_steps(records, "length_var"),
        "length_gap_pos_minus_neg": over_steps(records, "length_gap_pos_minus_neg"),
    }


def first_step(records: list[dict]) -> list[dict]:
    """The records of a run's first training step: its rollouts come from the starting policy,
    the same batch for every rule of a seed."""
    steps = [r["step"] for r in records if "pg_loss" in r]
    return [r for r in records if "pg_loss" in r and r["step"] == min(steps)] if steps else []


def mean_of(values: list[float]) -> float:
    xs = [v for v in values if not math.isnan(v)]
    return sum(xs) / len(xs) if xs else math.nan


def fmt(x: float, spec: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
