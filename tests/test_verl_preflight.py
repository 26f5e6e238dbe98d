"""The verl entry's preflight on CPU (megatron_ba/integrations/verl/verl_preflight.py): a paper
recipe translated for verl and pointed at a tiny local Hugging Face model and DAPO-Math / MATH-500
rows in verl's parquet layout (tests/verl_run_files.py) runs through the real entry's main
(`python -m megatron_ba.integrations.verl.main_ppo`, run in this process: verl is imported once;
tests/test_verl_slurm.py runs it as its own process in a Slurm job), which checks verl's config,
reads the files and one batch with verl's RLHFDataset and collate_fn, scores the batch with verl's
reward manager and, with no CUDA GPU, ends with its one line and exit status NEEDS_GPU.

The negative controls, through the same entry: a training file with no rows, verl's own DAPO
reward in place of this project's (it scores a wrong answer -1, not 0: the reward disagrees with
the data's scale) and a reward file that does not exist each fail naming the cause, without the
GPU line.

Runs in .venv-verl (bash scripts/run_verl_tests.sh).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

from verl_run_files import BATCH, LINE, RECIPE, dapo_rows, write_parquet, write_run_files
from verl_test_env import no_ba_environment  # noqa: F401 (autouse fixture)

from megatron_ba.integrations.engines.verl import ENTRY, recipe_to_verl_overrides
from megatron_ba.integrations.verl.verl_preflight import NEEDS_GPU, PREFIX
from megatron_ba.recipe import load_recipe


@pytest.fixture(autouse=True)
def same_environ(monkeypatch):
    """HF datasets' map with num_proc (verl's prompt-length filter) rebinds os.environ to a copy
    (datasets/arrow_dataset.py, `os.environ = prev_env`), where the environment fixtures' undo
    would not reach: os.environ itself is put back first (monkeypatch undoes attributes before
    items), then their changes are undone on it."""
    monkeypatch.setattr(os, "environ", os.environ)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_run_files(tmp_path_factory.mktemp("verl-run"))


def _entry_args(files, run_dir: Path, *extra: str, reward: Path | None = None) -> list[str]:
    """The entry's arguments for the recipe with `extra` (recipe overrides); `reward`: verl's
    custom_reward_function.path replaced (the recipe has no key for it)."""
    recipe = load_recipe(RECIPE, files.recipe_overrides(*extra))
    overrides = recipe_to_verl_overrides(recipe, nodes=1, gpus_per_node=1, run_dir=str(run_dir))
    if reward is not None:
        key = "reward.custom_reward_function.path="
        overrides = [f"{key}{reward}" if o.startswith(key) else o for o in overrides]
    return [*ENTRY, *overrides, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


def _entry(files, tmp_path, monkeypatch, capsys, *extra: str, reward: Path | None = None):
    """main_ppo.main in this process (verl is imported once) on the translated overrides, as
    `python -m megatron_ba.integrations.verl.main_ppo` runs it (tests/test_verl_slurm.py runs
    that process, in a Slurm job): its exit status and what it printed."""
    from megatron_ba.integrations.verl import main_ppo

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = _entry_args(files, tmp_path, *extra, reward=reward)
    monkeypatch.setattr(sys, "argv", ["main_ppo", *args[2:]])
    with pytest.raises(SystemExit) as stop:
        main_ppo.main()
    return stop.value.code, capsys.readouterr()


def test_the_entry_checks_config_data_and_reward_and_stops_without_a_gpu(
    files, tmp_path, monkeypatch, capsys
):
    code, out = _entry(files, tmp_path, monkeypatch, capsys)
    assert code == NEEDS_GPU, out.err[-3000:]
    assert [line for line in out.out.splitlines() if line.startswith(PREFIX)] == [LINE]
    assert "preflight failed" not in out.err


def _fails(files, tmp_path, monkeypatch, capsys, *extra: str, reward: Path | None = None) -> str:
    """The entry on a bad input: the preflight's message on stderr, exit status 1, no GPU line."""
    code, out = _entry(files, tmp_path, monkeypatch, capsys, *extra, reward=reward)
    assert code == 1, out.err[-3000:]
    assert "stopping before training" not in out.out
    (message,) = [line for line in out.err.splitlines() if "preflight failed" in line]
    print(message)  # pytest -s: what a user reads
    return message


def test_a_training_file_with_no_rows_is_refused_by_name(files, tmp_path, monkeypatch, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(dapo_rows()).slice(0, 0), empty)  # the schema, no rows
    message = _fails(files, tmp_path, monkeypatch, capsys, f"data.path={empty}")
    assert f"data.train_files: {empty}: the file has no rows" in message


def test_a_missing_model_folder_is_refused_by_name(files, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-model"
    message = _fails(files, tmp_path, monkeypatch, capsys, f"model.pretrained={missing}")
    key = "actor_rollout_ref.model.path"
    assert f"{key}: verl could not load the model folder '{missing}'" in message


def test_too_few_prompts_for_a_step_are_refused(files, tmp_path, monkeypatch, capsys):
    short = write_parquet(tmp_path / "short.parquet", dapo_rows()[: BATCH - 1])
    message = _fails(files, tmp_path, monkeypatch, capsys, f"data.path={short}")
    assert f"{BATCH - 1} prompt(s) after verl's filters, fewer than one step's" in message
    assert f"data.train_batch_size={BATCH}" in message


DAPO_SCORE = """from verl.utils.reward_score.math_dapo import compute_score as dapo


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return dapo(solution_str, ground_truth)
"""


def test_a_reward_that_disagrees_with_the_data_is_refused(files, tmp_path, monkeypatch, capsys):
    """verl's own DAPO score (verl/utils/reward_score/math_dapo.py) in place of this project's:
    it pays a wrong answer -1, not 0, which the preflight refuses naming the row."""
    reward = tmp_path / "dapo_reward.py"
    reward.write_text(DAPO_SCORE)
    message = _fails(files, tmp_path, monkeypatch, capsys, reward=reward)
    assert re.search(r"row \d+ of the training batch \(index '\w+', data_source 'math_dapo'\)",
                     message), message  # fmt: skip
    assert "scores -1.0 for the response" in message and "not 0.0" in message
    assert "the data and the reward disagree" in message


def test_a_ground_truth_the_reward_cannot_read_is_refused(files, tmp_path, monkeypatch, capsys):
    """One row's ground truth over two lines: the reward reads a response's last line only, so
    that row's right answer scores 0; the preflight names the row by its index."""
    rows = dapo_rows()[:BATCH]  # one batch: the broken row is in it whatever the sampler's order
    rows[1]["reward_model"] = {"ground_truth": "3\n4", "style": "rule"}
    broken = rows[1]["extra_info"]["index"]
    data = write_parquet(tmp_path / "broken.parquet", rows)
    message = _fails(files, tmp_path, monkeypatch, capsys, f"data.path={data}")
    assert f"(index {broken!r}, data_source 'math_dapo'), ground truth '3\\n4'" in message
    assert "scores 0.0 for the response" in message and "not 1.0" in message


def test_a_missing_reward_file_is_refused_by_name(files, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-reward.py"
    message = _fails(files, tmp_path, monkeypatch, capsys, reward=missing)
    loader = "reward.custom_reward_function: verl could not load 'compute_score' from"
    assert f"{loader} '{missing}'" in message
