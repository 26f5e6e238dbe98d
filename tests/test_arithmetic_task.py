"""The synthetic arithmetic task: its expression space and the held-out split's size."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_ba.tasks.arithmetic import (
    ArithmeticTask,
    answer_of,
    correct_solution,
    sloppy_solution,
)


@pytest.mark.parametrize("terms", [2, 3])
def test_expressions_are_the_space_random_prompts_come_from(terms):
    task = ArithmeticTask(min_terms=terms, max_terms=terms)
    space = list(task._expressions(terms))
    assert len(space) == len(set(space)) == 10 * 11 ** (terms - 1)
    rng = random.Random(0)
    drawn = {task._random_prompt(rng) for _ in range(20_000)}
    assert drawn <= set(space)
    if terms == 2:  # small enough that 20,000 draws find every expression
        assert drawn == set(space)


def test_the_held_out_split_can_be_asked_for_whole_but_not_more():
    task = ArithmeticTask(min_terms=2, max_terms=3)
    available = task.eval_split_size
    held_out = {p for n in (2, 3) for p in task._expressions(n) if task._is_eval(p)}
    assert available == len(held_out) == 114  # fewer than the default data.eval_prompts, 128
    prompts = task.prompts("eval", available)
    assert set(prompts) == held_out
    # Drawing distinct prompts until 128 are found never ended before this check.
    with pytest.raises(ValueError, match=r"data\.eval_prompts: 128 .* only 114"):
        task.prompts("eval", 128)


def test_large_spaces_are_not_enumerated():
    task = ArithmeticTask(min_terms=2, max_terms=6)
    assert task.eval_split_size is None
    assert len(set(task.prompts("eval", 500))) == 500


def test_sloppy_restates_sets_how_much_longer_the_wrong_style_is():
    prompt = "3+5-2+3="
    right = correct_solution(prompt)
    assert right == "3+5=8, 8-2=6, 6+3=9. Answer: 9"
    sloppy = {r: sloppy_solution(prompt, random.Random(7), r) for r in (0, 1, 2)}
    # One slip in the right style: as long as the right answer (single digits), and wrong.
    assert len(sloppy[0]) == len(right) and sloppy[0] != right
    assert sloppy[0].count(", ") == 2 and "so" not in sloppy[0]
    # The same slip, each running value restated once more per level.
    assert sloppy[1] == "3+5=8, so 8. 8-2=5, so 5. 5+3=8, so 8. Answer: 8"
    assert sloppy[2] == "3+5=8, so 8, so 8. 8-2=5, so 5, so 5. 5+3=8, so 8, so 8. Answer: 8"
    assert answer_of(prompt) == 9


def test_the_warm_start_mixture_follows_the_task_settings():
    task = ArithmeticTask(min_terms=4, max_terms=4, restates=2)
    examples = task.warmstart_examples(2000, correct_fraction=0.25)
    right = [r for p, r in examples if r == correct_solution(p)]
    assert abs(len(right) / len(examples) - 0.25) < 0.03
    assert all(r.count(", so ") == 6 for p, r in examples if r != correct_solution(p))
    with pytest.raises(ValueError, match=r"data\.sloppy_restates: .* got 5"):
        ArithmeticTask(restates=5)


def test_warmstart_seed_gives_the_seeds_of_a_study_one_starting_policy():
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.warmstart import cache_key

    recipe = "recipes/testbed-gap-cpu.yaml"
    fixed = {s: load_recipe(recipe, [f"seed={s}", "warmstart.seed=0"]) for s in (0, 3)}
    assert cache_key(fixed[0]) == cache_key(fixed[3])
    own = {s: load_recipe(recipe, [f"seed={s}", "warmstart.seed=null"]) for s in (0, 3)}
    assert cache_key(own[0]) != cache_key(own[3])  # each run seed its own warm start
    assert cache_key(own[0]) == cache_key(fixed[0])  # seed 0 either way: one policy


def test_the_shared_warm_start_cache_is_keyed_by_the_code_and_releases_too(monkeypatch, tmp_path):
    """Warm starts live outside the checkout (every clone's `train` finds them), so the key
    covers what a clone on another commit or environment would train differently: the torch and
    transformers releases and the procedure's source. Controls: each changed alone moves the key."""
    import argparse

    import torch

    from megatron_ba.commands import train as train_command
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train import warmstart

    recipe = load_recipe("recipes/tiny-cpu.yaml", [])
    key = warmstart.cache_key(recipe)
    assert warmstart.cache_key(load_recipe("recipes/tiny-cpu.yaml", [])) == key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert warmstart.cache_key(recipe) != key
    monkeypatch.undo()
    fake_root = tmp_path / "megatron_ba"
    for name in warmstart._PROCEDURE:
        (fake_root / name).parent.mkdir(parents=True, exist_ok=True)
        (fake_root / name).write_bytes((Path(warmstart.__file__).parents[1] / name).read_bytes())
    monkeypatch.setattr(warmstart, "__file__", str(fake_root / "train/warmstart.py"))
    assert warmstart.cache_key(recipe) == key  # the same sources elsewhere: the same key
    with open(fake_root / "tasks/arithmetic.py", "a") as f:
        f.write("\n# another commit\n")
    assert warmstart.cache_key(recipe) != key
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    assert parser.parse_args(["r.yaml"]).cache_dir == tmp_path / "xdg/megatron-ba"


def test_runs_that_share_the_cache_train_one_warm_start(monkeypatch, tmp_path):
    """Two runs asking for one missing warm start at once (two clones, a study's elements side
    by side): the first trains, the second waits for its lock and takes the result, so neither
    replaces a folder the other may be reading. The training itself is a stand-in that takes a
    moment and counts its calls. Control: without the lock both train."""
    import contextlib
    import threading
    import time

    from megatron_ba.recipe import load_recipe
    from megatron_ba.train import warmstart

    recipe = load_recipe("recipes/tiny-cpu.yaml", [])
    trained = []

    def stand_in(recipe, out, log):
        trained.append(out)
        time.sleep(0.5)  # long enough for the other run to find the entry missing
        out.mkdir(parents=True, exist_ok=True)
        (out / "DONE").write_text("ok\n")
        return out

    def two_runs(cache: Path) -> list[str]:
        logs: list[str] = []
        runs = [
            threading.Thread(target=warmstart.run_warmstart, args=(recipe, cache, logs.append))
            for _ in range(2)
        ]
        for run in runs:
            run.start()
            time.sleep(0.1)
        for run in runs:
            run.join()
        return logs

    monkeypatch.setattr(warmstart, "_train", stand_in)
    logs = two_runs(tmp_path / "locked")
    assert len(trained) == 1
    assert any("another run is training this warm start; waiting" in line for line in logs)
    assert any("cached (trained by another run meanwhile)" in line for line in logs)

    trained.clear()
    monkeypatch.setattr(warmstart, "_exclusive", lambda path, log: contextlib.nullcontext())
    two_runs(tmp_path / "unlocked")
    assert len(trained) == 2  # the control: the second run trained too
