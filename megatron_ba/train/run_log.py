"""What a run writes to its folder: metrics.jsonl, samples.jsonl, recipe.yaml, summary.json, plots.

    folder = RunFolder(run_dir)
    folder.prepare(recipe, resume=False)       # rank 0: refuses to overwrite a finished run
    folder.metrics.append({"step": 1, ...})    # one JSON object per optimiser step, fsynced
    folder.log_samples(step, prompts, samples, rewards)
    folder.finish()                            # summary.json; returns the summary

metrics.jsonl: evaluation lines share the step number of the training step they follow
(step 0: the warm-start policy, before any GRPO update) and carry `eval_accuracy`. On resume the
file is cut back to the checkpoint's step, so that the steps redone after it are not logged twice.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megatron_ba.train.tracking import Tracking


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


class RunFolder:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir)
        self.metrics = MetricsLog(self.path / "metrics.jsonl")
        self.tracking = Tracking()  # none until start_tracking

    def start_tracking(self, recipe, *, resume_step: int = 0) -> None:
        """TensorBoard / W&B as the recipe's logging section asks (train/tracking.py)."""
        self.tracking = Tracking.start(recipe, self.path, resume_step=resume_step)

    def record(self, record: dict) -> None:
        """One line of metrics.jsonl, and the same numbers to the trackers."""
        self.metrics.append(record)
        self.tracking.log(record)

    def prepare(self, recipe, *, resume: bool) -> None:
        """Create the folder and write the resolved recipe (rank 0)."""
        if not resume and self.metrics.path.is_file():
            raise FileExistsError(
                f"--run-dir: {self.path} already holds a run; pass --resume {self.path} "
                f"to continue it, or choose another --run-dir"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        recipe.dump(self.path / "recipe.yaml")

    def truncate_after(self, step: int) -> None:
        """Forget what steps after `step` wrote (a resume redoes them): metrics and samples."""
        self.metrics.truncate_after(step)
        samples = self.path / "samples.jsonl"
        if samples.is_file():
            keep = [
                line
                for line in samples.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step
            ]
            tmp = samples.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, samples)

    def log_samples(self, step: int, prompts, samples, rewards, per_step: int = 2) -> None:
        """A few rollouts per step in samples.jsonl: what the policy writes, and its reward."""
        G = len(samples[0])
        with (self.path / "samples.jsonl").open("a") as f:
            for i in range(min(per_step, len(prompts))):
                for j in range(min(2, G)):
                    s = samples[i][j]
                    rec = {
                        "step": step,
                        "prompt": prompts[i],
                        "response": s.text,
                        "tokens": len(s.token_ids),
                        "reward": rewards[i * G + j],
                    }
                    f.write(json.dumps(rec) + "\n")

    def finish(self) -> dict:
        """summary.json from metrics.jsonl; returns the summary (train/plots.py draws the rest)."""
        self.tracking.close()
        summary = summarize(self.metrics.read())
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def summarize(records: list[dict]) -> dict:
    """Peak and last held-out accuracy, the step-0 baseline, and the time spent."""
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    out: dict = {"steps": max((r["step"] for r in records), default=0)}
    if evals:
        peak = max(evals, key=lambda e: e[1])
        out.update(
            eval_accuracy_start=evals[0][1],
            eval_accuracy_peak=peak[1],
            eval_accuracy_peak_step=peak[0],
            eval_accuracy_last=evals[-1][1],
            eval_gain_last=evals[-1][1] - evals[0][1],
        )
    times: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("time/") and isinstance(v, int | float):
                times[k] = times.get(k, 0.0) + v
    out["seconds"] = {k: round(v, 2) for k, v in times.items()}
    pg = [r["pg_loss"] for r in records if isinstance(r.get("pg_loss"), int | float)]
    out["pg_loss_mean_abs"] = sum(abs(x) for x in pg) / len(pg) if pg else math.nan
    table = eval_table(records)
    if table:
        out["eval_table"] = table
    return out


def eval_table(records: list[dict]) -> dict:
    """The paper's table of one run: each benchmark's Acc@k and Best@k at the peak step (the
    evaluation with the highest mean Acc@k over benchmarks; the earliest on ties) and at the last.

    {"peak_step", "last_step", "benchmarks": {name: {"acc_peak", "acc_last", "best_peak",
    "best_last"}}, "average": {the same four, the means over benchmarks}}; {} without evaluations.
    """
    evals = [r for r in records if isinstance(r.get("eval_accuracy"), int | float)]
    if not evals:
        return {}
    peak = max(evals, key=lambda r: (r["eval_accuracy"], -r["step"]))
    last = evals[-1]
    names = sorted({k.split("/")[1] for k in last if k.startswith("eval/") and k.endswith("/acc")})
    table = {
        name: {
            "acc_peak": peak[f"eval/{name}/acc"],
            "acc_last": last[f"eval/{name}/acc"],
            "best_peak": peak[f"eval/{name}/best"],
            "best_last": last[f"eval/{name}/best"],
        }
        for name in names
    }
    average = {
        "acc_peak": peak["eval_accuracy"],
        "acc_last": last["eval_accuracy"],
        "best_peak": peak.get("eval_best_at_k", math.nan),
        "best_last": last.get("eval_best_at_k", math.nan),
    }
    return {
        "peak_step": peak["step"],
        "last_step": last["step"],
        "benchmarks": table,
        "average": average,
    }
