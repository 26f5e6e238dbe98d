"""The run folder's metrics.jsonl: one JSON object per optimiser step, appended and flushed.

Evaluation lines share the step number of the training step they follow (step 0: the warm-start
policy, before any GRPO update) and carry `eval_accuracy`. On resume the file is cut back to the
checkpoint's step, so that the steps redone after it are not logged twice.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; absent statistics (a batch without negatives) are null
    return v


class MetricsLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    def truncate_after(self, step: int) -> None:
        """Keep the records of steps <= `step` (atomically rewritten)."""
        keep = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)
