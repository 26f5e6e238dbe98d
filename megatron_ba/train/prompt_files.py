"""A recipe's prompts as JSON Lines files, one {"prompt": ..., "ground_truth": ...} per line, for
a training loop that reads prompt files (NeMo-Aligner's: integrations/nemo_aligner/train_grpo.py).

    train, validation = write_prompt_files(recipe, run_dir / "data")

train.jsonl holds the first grpo.steps x grpo.prompts_per_step prompts of the stream the local
backend draws from (train/driver.py: the same prompts in the same order), val.jsonl the
data.eval_prompts held-out prompts it evaluates on. Both are written beside and renamed into
place, so that processes writing them at the same time (one per GPU under srun) leave one whole
copy and a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_ba.recipe import Recipe
from megatron_ba.tasks import build_task
from megatron_ba.tokenization import load_hf_tokenizer

TRAIN_FILE = "train.jsonl"
VALIDATION_FILE = "val.jsonl"


def prompt_file_paths(folder: str | Path) -> tuple[Path, Path]:
    """Where write_prompt_files puts the train and the validation file."""
    folder = Path(folder)
    return folder / TRAIN_FILE, folder / VALIDATION_FILE


def write_prompt_files(
    recipe: Recipe, folder: str | Path, *, train_prompts: int | None = None
) -> tuple[Path, Path]:
    """Write the recipe's train and held-out prompts with their ground truths under `folder`.

    train_prompts: how many of the train stream (default grpo.steps x grpo.prompts_per_step,
    what a run of the recipe consumes). A math recipe needs its model's tokenizer (its chat
    template renders the prompts): tokenizer.kind hf and a folder in tokenizer.path or
    model.pretrained (a .nemo file holds none this reads).
    """
    task = build_task(recipe, _math_tokenizer(recipe))
    count = (
        recipe.grpo.steps * recipe.grpo.prompts_per_step if train_prompts is None else train_prompts
    )
    train, validation = prompt_file_paths(folder)
    train.parent.mkdir(parents=True, exist_ok=True)
    held_out = task.prompts("eval", recipe.data.eval_prompts)
    if len(held_out) < recipe.data.eval_prompts:
        raise ValueError(
            f"data.eval_prompts: the task holds back {len(held_out)} prompts, not "
            f"{recipe.data.eval_prompts} (a math recipe with eval.benchmarks holds back none); "
            "validation needs them: set eval.benchmarks to an empty list, or data.eval_prompts"
        )
    for path, prompts in ((train, task.prompts("train", count)), (validation, held_out)):
        rows = [{"prompt": p, "ground_truth": task.answer(p)} for p in prompts]
        _replace(path, "".join(json.dumps(r) + "\n" for r in rows))
    return train, validation


def _math_tokenizer(recipe: Recipe):
    """The math task's tokenizer (None for the arithmetic task, which needs none)."""
    if recipe.data.task != "math":
        return None
    folder = recipe.tokenizer.path or recipe.model.pretrained
    if recipe.tokenizer.kind != "hf" or folder is None or not Path(folder).is_dir():
        raise ValueError(
            "tokenizer.path: the math task renders its prompts with the model's chat template; "
            "set tokenizer.kind=hf and tokenizer.path to the model's Hugging Face folder "
            f"(got kind={recipe.tokenizer.kind!r}, folder={folder!r})"
        )
    return load_hf_tokenizer(folder)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a part
