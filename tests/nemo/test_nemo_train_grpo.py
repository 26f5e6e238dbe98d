"""NeMo-Aligner's own GRPO loop end to end on CPU: `python -m ...nemo_aligner.train_grpo`.

A tiny NeMo checkpoint (`megatron-ba nemo-tiny-model`: the local backend's warm start saved as a
.nemo) trains for a few steps through NeMo-Aligner's `fit` (rollouts by NeMo's generation,
in-process math rewards, the BA loss, torch's AdamW through NeMo, validation, NeMo's TensorBoard
logger, checkpoints) and the runs are compared with each other through their metrics.jsonl:

* TP=2 and DP=2 (two gloo processes under torchrun) give TP=1's metrics (float tolerance);
* a run stopped after a checkpoint and started again (NeMo's resume) gives the uninterrupted run's
  metrics exactly;
* micro-batches of 2 give what one micro-batch of 8 gives (the BA loss is exact per micro-batch),
  while NeMo-Aligner's per-micro-batch mean (per_microbatch_mean_train_grpo.py) does not.

Prompts in file order (model.data.shuffle=False: NeMo's random sampler draws each DP rank's
prompts from its own part of the data) and one prompt per rollout micro-batch make the rollouts
independent of the layout (the trainer seeds every generate call by step, prompt and sample).
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_nemo, nemo_env

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]

CONTROL = Path(__file__).resolve().parent / "per_microbatch_mean_train_grpo.py"
STEPS = 4
# 4 prompts x 4 samples of up to 24 tokens per step; one update of 16 sequences per step.
SMALL = [
    "trainer.accelerator=cpu", "trainer.precision=32", "model.megatron_amp_O2=False",
    "model.optim.name=adamw", "~model.optim.bucket_cap_mb", "~model.optim.overlap_grad_sync",
    "~model.optim.contiguous_grad_buffer", "model.optim.lr=5e-4",
    "model.micro_batch_size=8", "model.global_batch_size=16",
    "model.reinforce.num_rollout_samples=4", "model.reinforce.rollout_micro_batch_size=1",
    "model.reinforce.forward_micro_batch_size=4", "model.reinforce.offload_adam_states=False",
    "model.reinforce.num_val_samples=8", "model.reinforce.val_rollout_micro_batch_size=1",
    "model.reinforce.length_params.max_length=24", "trainer.reinforce.num_rollouts_per_prompt=4",
    "trainer.reinforce.val_check_interval=2", "trainer.reinforce.save_interval=2",
    "model.data.shuffle=False",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tiny: Path, run_dir: Path, *overrides: str, nproc: int = 1, entry=None) -> list[dict]:
    """Run train_grpo (or `entry`, a script) and return its metrics.jsonl rows."""
    main = [str(entry)] if entry else ["-m", "megatron_ba.integrations.nemo_aligner.train_grpo"]
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={_free_port()}"]  # fmt: skip
        main = main if entry else ["-m", main[1]]
    args = [
        f"++pretrained_checkpoint.restore_from_path={tiny / 'model.nemo'}",
        f"++model.data.data_prefix.train={tiny / 'train.jsonl'}",
        f"++model.data.data_prefix.validation={tiny / 'val.jsonl'}",
        f"exp_manager.explicit_log_dir={run_dir}", f"trainer.devices={nproc}",
        f"trainer.reinforce.max_steps={STEPS}", *SMALL, *overrides,
    ]  # fmt: skip
    proc = subprocess.run([*launch, *main, *args], env=nemo_env(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"train_grpo failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict], *, parts: bool = True) -> list[dict]:
    """Rows without timings; without `parts`, also without the `_part` diagnostics (one DP
    rank's additive share of an objective: a different layout splits it differently)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and (parts or "_part" not in k)}
        for r in rows
    ]


def assert_close(rows: list[dict], ref: list[dict], rel: float = 1e-4, abs_: float = 1e-6):
    rows, ref = comparable(rows, parts=False), comparable(ref, parts=False)
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for got, want in zip(rows, ref, strict=True):
        assert got.keys() == want.keys()
        for k, w in want.items():
            g = got[k]
            if isinstance(w, float) and isinstance(g, float):
                assert math.isclose(g, w, rel_tol=rel, abs_tol=abs_), (got["step"], k, g, w)
            else:
                assert g == w, (got["step"], k, g, w)


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nemo_base")
    return run_dir, train(tiny, run_dir)


def test_train_grpo_trains_validates_logs_and_checkpoints(base):
    run_dir, rows = base
    train_rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [2, 4]
    assert all(r["updates_applied"] == 1 and math.isfinite(r["loss"]) for r in train_rows)
    assert any(r["reward_mean"] > 0 for r in train_rows)  # a learning signal from the warm start
    assert any(r["grad_norm"] > 0 for r in train_rows)
    assert any(r["ba/num_pos"] > 0 and r["ba/num_neg"] > 0 for r in train_rows)
    events = list(run_dir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0  # NeMo's TensorBoard logger
    ckpts = run_dir / "checkpoints"
    last = list(ckpts.glob(f"megatron_gpt-step={STEPS}-*-last"))
    assert last and (last[0] / "metadata.json").is_file()
    assert list(ckpts.glob("*.nemo"))  # save_nemo_on_train_end


def test_resume_continues_exactly(tiny, base, tmp_path):
    _, ref = base
    train(tiny, tmp_path, "trainer.reinforce.max_steps=2")  # stops after the step-2 checkpoint
    rows = train(tiny, tmp_path)  # NeMo's resume_if_exists picks it up
    assert comparable(rows) == comparable(ref)


def test_tp2_gives_tp1_metrics(tiny, base, tmp_path):
    _, ref = base
    assert_close(train(tiny, tmp_path, "model.tensor_model_parallel_size=2", nproc=2), ref)


def test_dp2_gives_dp1_metrics(tiny, base, tmp_path):
    _, ref = base
    assert_close(train(tiny, tmp_path, nproc=2), ref)


def test_micro_batches_do_not_change_the_ba_objective(tiny, base, tmp_path):
    _, ref = base
    assert_close(train(tiny, tmp_path, "model.micro_batch_size=2"), ref)


def test_per_microbatch_mean_depends_on_the_micro_batches(tiny, tmp_path):
    """Negative control: the comparison above fails for NeMo-Aligner's per-micro-batch mean."""
    one = train(tiny, tmp_path / "mbs8", entry=CONTROL)
    four = train(tiny, tmp_path / "mbs2", "model.micro_batch_size=2", entry=CONTROL)
    with pytest.raises(AssertionError):
        assert_close(four, one)
