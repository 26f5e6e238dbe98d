"""A study as one Slurm job array: element i is array task i, a normal run of
slurm/grpo_balanced.sh (its own fit check, preemption, requeue and resume).

    cmd = array_submission(study, sbatch_args=["--time=04:00:00"], max_parallel=4)
    subprocess.run(cmd)                    # megatron-ba study ... --slurm

The tasks get MBA_STUDY (the study folder) and CACHE_DIR (its warm-start cache) in their
environment; slurm/grpo_balanced.sh then reads the task's run folder and overrides from
study.json (`python -m megatron_ba.studies.grid element DIR $SLURM_ARRAY_TASK_ID`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_ba.studies.grid import Study

BATCH = Path(__file__).resolve().parents[2] / "slurm" / "grpo_balanced.sh"


def array_submission(
    study: Study, *, sbatch_args: list[str], max_parallel: int | None
) -> list[str]:
    """The sbatch command of the whole study: --array=0-(N-1)[%K]."""
    n = len(study.elements)
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"--max-parallel: must be >= 1, got {max_parallel}")
    array = f"0-{n - 1}" + (f"%{max_parallel}" if max_parallel else "")
    folder = study.folder.resolve()
    home = BATCH.parents[1]  # the checkout (a task's script is a spooled copy)
    env = f"ALL,MBA_STUDY={folder},CACHE_DIR={folder / '.cache'},MBA_HOME={home}"
    return [
        "sbatch",
        "--parsable",
        f"--array={array}",
        f"--job-name={folder.name}",
        f"--export={env}",
        f"--output={folder / 'slurm-%A_%a.out'}",
        *sbatch_args,
        str(BATCH),
        study.recipe,
    ]


def parse_sbatch_args(text: str) -> list[str]:
    """--sbatch-args "..." as words (shell quoting); ValueError naming the flag if unbalanced."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ValueError(f"--sbatch-args {text!r}: {e}") from None
