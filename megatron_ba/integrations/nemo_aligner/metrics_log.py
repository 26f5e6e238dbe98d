"""metrics.jsonl for a NeMo-Aligner run: one line per GRPO step, in the local backend's names.

`MetricsJsonl` is one more logger beside NeMo's (TensorBoard) in the trainer's
`CustomLoggerWrapper`: the parent's loop logs each step's rollout metrics (`train_rollouts/`),
every optimizer step's actor metrics (`train_optim/`), its timers (`timers/`, the step's last
call) and, after validation, `val_rollouts/`. NeMo counts steps from 0 before the update; the
file counts updates, like the local backend's (megatron_ba/train/run_log.py): the k-th update is
step k and the validation after it is a separate line with step k and `eval_accuracy`.

Names the local backend also writes are renamed to its names (`RENAMES`); the others keep
NeMo's prefixed names. With several optimizer steps per GRPO step the line has the last one's
actor metrics and `updates_applied`. On resume the file is cut back to the resumed step, so
the steps redone after the checkpoint are not logged twice (NeMo's exp_manager moves the file
into run_N/ when it resumes; it is carried back).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

RENAMES = {
    "train_rollouts/reward_mean": "reward_mean",
    "train_rollouts/generation_length": "length_mean",
    "train_rollouts/zero_variance_group_fraction": "adv/zero_variance_fraction",
    "train_rollouts/dropped_sequences": "adv/dropped_sequences",
    "val_rollouts/rewards": "eval_accuracy",
    "timers/rollout_time": "time/rollout",
    "timers/train_time": "time/train",
}


def _name(key: str) -> str:
    if key in RENAMES:
        return RENAMES[key]
    if key.startswith("train_optim/"):  # the actor's metrics: the core's names already
        return key.removeprefix("train_optim/")
    if key.startswith("timers/"):
        return "time/" + key.removeprefix("timers/")
    return key


def _plain(value):
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


class MetricsJsonl:
    """A logger for NeMo-Aligner's `CustomLoggerWrapper` (global rank 0 only)."""

    def __init__(self, path: str | Path, resume_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut(resume_step)
        self._line: dict = {}

    def _cut(self, resume_step: int) -> None:
        if not self.path.is_file() and resume_step > 0:
            self._carry_over()
        if not self.path.is_file():
            return
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def _carry_over(self) -> None:
        """NeMo's exp_manager moves a resumed run's files into run_N/ (N counting restarts):
        the newest moved metrics.jsonl comes back, to be cut to the resumed step."""
        moved = sorted(
            self.path.parent.glob(f"run_*/{self.path.name}"),
            key=lambda p: int(p.parent.name.removeprefix("run_") or -1),
        )
        if moved:
            self.path.write_bytes(moved[-1].read_bytes())

    def _append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        named = {_name(k): _plain(v) for k, v in metrics.items()}
        kinds = {k.split("/", 1)[0] for k in metrics}
        if "val_rollouts" in kinds:
            self._append({"step": int(step), **named})  # after update `step` (already counted)
            return
        if "train_optim" in kinds:
            named["updates_applied"] = self._line.get("updates_applied", 0) + 1
        self._line.update(named)
        if "timers" in kinds:  # the step's last call
            self._append({"step": int(step) + 1, **self._line})
            self._line = {}

    def log_hyperparams(self, params) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass
