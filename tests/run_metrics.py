"""Reading a run's metrics.jsonl for comparisons between runs, and killing a run after a
checkpoint (shared by the training tests)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path


def trajectory(run_dir: Path) -> list[dict]:
    """Every metrics line without its wall-clock timings (the only thing allowed to differ)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


def trajectory_mismatches(a: list[dict], b: list[dict], rel: float = 0.0) -> list[str]:
    """The first differences between two runs' metrics ([] when they agree): bit for bit, or
    with `rel` > 0 floats within that relative tolerance of each other (the rest still exact)."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return [f"steps {[r['step'] for r in a]} != {[r['step'] for r in b]}"]
    out = []
    for ra, rb in zip(a, b, strict=True):
        for k in sorted(set(ra) | set(rb)):
            x, y = ra.get(k, "absent"), rb.get(k, "absent")
            both_floats = isinstance(x, float) and isinstance(y, float)
            if x != y and not (rel > 0 and both_floats and math.isclose(x, y, rel_tol=rel)):
                out.append(f"step {ra['step']} {k}: {x} != {y}")
    return out


def kill_after_checkpoint(cmd: list[str], run_dir: Path, at_least: int, **popen) -> int:
    """Start `megatron-ba train` (cmd), SIGKILL it and its vLLM engine process once its latest
    checkpoint is at least step `at_least`; the step of that checkpoint."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        **popen,
    )
    latest = Path(run_dir) / "checkpoints" / "latest"
    deadline = time.time() + 900
    try:
        while time.time() < deadline and proc.poll() is None:
            if latest.is_file() and latest.read_text().strip() >= f"step-{at_least:06d}":
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its vLLM engine process
        proc.wait()
    name = latest.read_text().strip()
    assert (latest.parent / name / "meta.json").is_file()
    return int(name.split("-")[1])
