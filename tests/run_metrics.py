"""Reading a run's metrics.jsonl for comparisons between runs (shared by the training tests)."""

from __future__ import annotations

import json
from pathlib import Path


def trajectory(run_dir: Path) -> list[dict]:
    """Every metrics line without its wall-clock timings (the only thing allowed to differ)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


def trajectory_mismatches(a: list[dict], b: list[dict]) -> list[str]:
    """The first differences between two runs' metrics, bit for bit ([] when identical)."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return [f"steps {[r['step'] for r in a]} != {[r['step'] for r in b]}"]
    out = []
    for ra, rb in zip(a, b, strict=True):
        for k in sorted(set(ra) | set(rb)):
            if ra.get(k, "absent") != rb.get(k, "absent"):
                out.append(f"step {ra['step']} {k}: {ra.get(k, 'absent')} != {rb.get(k, 'absent')}")
    return out
