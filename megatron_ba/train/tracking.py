"""Experiment tracking beside metrics.jsonl: TensorBoard event files and Weights & Biases.

    tracking = Tracking.start(recipe, run_dir, resume_step=0)    # rank 0, once per process
    tracking.log(record)      # each record metrics.jsonl gets: its numbers, at record["step"]
    tracking.close()

`logging.tensorboard: true`: event files in RUN_DIR/tb, or STUDY/tb/<run folder name> for an
element of a study (MBA_STUDY in the environment, which `megatron-ba study` sets), so that
`tensorboard --logdir STUDY/tb` shows the whole study. Every number of a record is a scalar under
its metrics.jsonl name; an evaluation is also a markdown table (text `eval/table`). A resumed
run drops the events after its checkpoint's step (TensorBoard's purge_step), as metrics.jsonl
drops those lines, so the redone steps are not there twice.

`logging.wandb: {mode: offline | online, project, entity}`: a W&B run in RUN_DIR/wandb whose
config is the recipe and whose history holds the same scalars (offline: `wandb sync
RUN_DIR/wandb/offline-run-*` uploads it later). Its id is kept in RUN_DIR/wandb-run-id, so a
resumed run continues the same W&B run; a study's elements share the group = the study folder's
name. The packages are imported only when a run asks for them.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

STUDY_ENV = "MBA_STUDY"  # the study folder of a run that is one of its elements


def numbers(record: dict) -> dict[str, float]:
    """The record's scalars: its finite int and float values but the step (what metrics.jsonl
    holds as numbers: non-finite ones are null there; None and text are left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step"
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def eval_markdown(record: dict) -> str | None:
    """An evaluation record as a table (benchmark, Acc@k, Best@k); None for other records."""
    names = sorted(
        {k.split("/")[1] for k in record if k.startswith("eval/") and k.endswith("/acc")}
    )
    if not names:
        return None
    nan = float("nan")
    rows = [
        f"| {n} | {record[f'eval/{n}/acc']:.4f} | {record.get(f'eval/{n}/best', nan):.4f} |"
        for n in names
    ]
    return "\n".join(["| benchmark | Acc@k | Best@k |", "|---|---|---|", *rows])


class Tracking:
    """The trackers a recipe asks for (none: every call does nothing)."""

    def __init__(self, tensorboard=None, wandb_run=None) -> None:
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @classmethod
    def start(cls, recipe, run_dir: str | Path, *, resume_step: int = 0) -> Tracking:
        run_dir = Path(run_dir)
        study = os.environ.get(STUDY_ENV)
        tb = None
        if recipe.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = Path(study) / "tb" / run_dir.name if study else run_dir / "tb"
            tb = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)
        run = None
        if recipe.logging.wandb.mode != "disabled":
            run = _wandb_run(recipe, run_dir, Path(study).name if study else None)
        return cls(tb, run)

    def log(self, record: dict) -> None:
        step, values = int(record["step"]), numbers(record)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
            table = eval_markdown(record)
            if table is not None:
                self.tensorboard.add_text("eval/table", table, step)
            self.tensorboard.flush()
        if self.wandb_run is not None and values:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            # Stops this process's wandb-core service and takes its address (WANDB_SERVICE) out
            # of the environment: a process started later (a resumed run, a study's next
            # element) would otherwise join this service, which still counts a run of this id
            # as in use if its process was killed ("run ID ... is in use").
            wandb.teardown()
        self.tensorboard = self.wandb_run = None


def _wandb_run(recipe, run_dir: Path, group: str | None):
    """A W&B run for `run_dir`: the one its wandb-run-id names (a resume), else a new one."""
    import wandb

    settings = recipe.logging.wandb
    id_file = run_dir / "wandb-run-id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        mode=settings.mode,
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        name=run_dir.name,
        group=group,
        config=recipe.to_dict(),
    )
