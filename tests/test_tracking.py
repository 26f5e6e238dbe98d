"""Experiment tracking (train/tracking.py): TensorBoard and W&B (offline) hold the scalars of
metrics.jsonl, read back with TensorBoard's EventAccumulator and the wandb package's protobuf
records (tests/wandb_log.py); a resumed run's redone steps are not there twice; a study's elements
are grouped. tests/test_train_integration.py checks the same on a real run killed and resumed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("tensorboard", reason="requirements/cpu.txt pins tensorboard")
pytest.importorskip("wandb", reason="requirements/cpu.txt pins wandb")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_log import history, records, wait_for_exit_record

from megatron_ba.recipe import RecipeError, load_recipe
from megatron_ba.train.tracking import Tracking, numbers

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"
EVAL = {"step": 0, "eval_accuracy": 0.25, "eval/heldout/acc": 0.25, "eval/heldout/best": 0.5}


def _step(step: int, reward: float) -> dict:
    return {"step": step, "reward_mean": reward, "kl": None, "updates_applied": 1, "note": "x",
            "length_mean_pos": float("nan")}  # fmt: skip


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_holds_the_scalars_and_a_resume_drops_the_redone_steps(tmp_path):
    recipe = load_recipe(TINY, ["logging.tensorboard=true"])
    t = Tracking.start(recipe, tmp_path)
    for record in (EVAL, _step(1, 0.5), _step(2, 0.625), _step(3, 0.75)):
        t.log(record)
    t.close()
    # killed after step 3, resumed from the checkpoint of step 2: step 3 again, then 4
    t = Tracking.start(recipe, tmp_path, resume_step=2)
    t.log(_step(3, 0.7))
    t.log(_step(4, 0.8))
    t.close()
    steps, values = zip(*_scalars(tmp_path / "tb", "reward_mean"), strict=True)
    assert steps == (1, 2, 3, 4) and values == pytest.approx((0.5, 0.625, 0.7, 0.8))
    assert _scalars(tmp_path / "tb", "eval_accuracy") == [(0, 0.25)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert not {"kl", "note", "length_mean_pos"} & set(acc.Tags()["scalars"])  # null in the jsonl
    (text,) = acc.Tensors("eval/table/text_summary")
    assert "| heldout | 0.2500 | 0.5000 |" in text.tensor_proto.string_val[0].decode()


def test_wandb_offline_holds_the_scalars_the_recipe_and_the_study(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    monkeypatch.setenv("MBA_STUDY", str(tmp_path / "my-study"))
    recipe = load_recipe(TINY, ["logging.wandb.mode=offline", "logging.wandb.project=mba",
                                "logging.tensorboard=true"])  # fmt: skip
    run = tmp_path / "my-study" / "token-seed0"
    run.mkdir(parents=True)
    t = Tracking.start(recipe, run)
    for record in (EVAL, _step(1, 0.5), _step(2, 0.625)):
        t.log(record)
    t.close()
    # close() stopped the service: no later process of this one's joins it (WANDB_SERVICE)
    assert "WANDB_SERVICE" not in os.environ
    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    wait_for_exit_record(path)
    got = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history(path)]
    assert got == [numbers(r) for r in (EVAL, _step(1, 0.5), _step(2, 0.625))]
    assert [row["_step"] for row in history(path)] == [0, 1, 2]
    (header,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    assert header.run_group == "my-study" and header.display_name == "token-seed0"
    config = {item.key for item in header.config.update}
    assert {"loss", "grpo", "logging"} <= config  # the recipe
    assert (run / "wandb-run-id").read_text().strip() == header.run_id  # a resume reuses it
    # a study's TensorBoard folder: STUDY/tb/<run>, so one logdir shows the study
    assert _scalars(tmp_path / "my-study" / "tb" / "token-seed0", "reward_mean")[-1][0] == 2


def test_no_tracking_unless_asked(tmp_path):
    t = Tracking.start(load_recipe(TINY), tmp_path)
    t.log(_step(1, 0.5))
    t.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["logging.wandb.mode=offline"], r"logging\.wandb\.project: required with"),
        (["logging.wandb.mode=cloud"], r"logging\.wandb\.mode: must be one of disabled, offline"),
    ],
)
def test_bad_wandb_settings_name_the_key(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(TINY, overrides)
