"""The recipe's prompts as JSON Lines (train/prompt_files.py): the local backend's stream, in
its order, for loops that read prompt files (the NeMo-Aligner backend)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ba.recipe import load_recipe
from megatron_ba.tasks import build_task
from megatron_ba.train.prompt_files import prompt_file_paths, write_prompt_files

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_files_hold_the_local_backends_prompts_in_its_order(tmp_path):
    recipe = load_recipe(TINY, ["grpo.steps=3", "grpo.prompts_per_step=5", "data.eval_prompts=7"])
    train, validation = write_prompt_files(recipe, tmp_path / "data")
    assert (train, validation) == prompt_file_paths(tmp_path / "data")
    task = build_task(recipe)
    # what the local driver draws: the stream from offset 0, step after step
    stream = [p for step in range(3) for p in task.prompts("train", 5, offset=5 * step)]
    assert [r["prompt"] for r in _rows(train)] == stream
    assert [r["prompt"] for r in _rows(validation)] == task.prompts("eval", 7)
    for row in _rows(train) + _rows(validation):
        assert row["ground_truth"] == str(eval(row["prompt"].rstrip("=")))  # arithmetic: exact
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.jsonl", "val.jsonl"]


def test_train_prompts_and_a_rewrite_replace_the_whole_file(tmp_path):
    recipe = load_recipe(TINY, ["data.eval_prompts=2"])
    train, _ = write_prompt_files(recipe, tmp_path, train_prompts=11)
    assert len(_rows(train)) == 11
    write_prompt_files(recipe, tmp_path, train_prompts=4)
    assert len(_rows(train)) == 4  # not the old file's tail after the new rows
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_math_recipe_without_a_tokenizer_folder_names_tokenizer_path(tmp_path):
    math = ["data.task=math", "data.path=/nowhere.parquet", "model.pretrained=/ckpt/m.nemo",
            "warmstart.enabled=false", "tokenizer.kind=hf"]  # fmt: skip
    recipe = load_recipe(TINY, math)
    with pytest.raises(ValueError, match=r"^tokenizer\.path: the math task renders"):
        write_prompt_files(recipe, tmp_path)
    assert not tmp_path.joinpath("train.jsonl").exists()
