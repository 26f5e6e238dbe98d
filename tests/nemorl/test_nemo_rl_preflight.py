"""The preflight of run_grpo_balanced (megatron_ba/integrations/nemo_rl/nemo_rl_preflight.py)
through the real entry, as `megatron-ba train RECIPE backend=nemo_rl` execs it, on CPU: the
tokenizer of a tiny local model, DAPO-Math-17k rows and benchmark files through NeMo-RL's data
processors, the math environment's dapo_math_verify on the first batch, then the documented line and
exit status NEEDS_GPU. Negative controls: a benchmark file with no rows, and a training row whose
ground truth the verifier cannot match, each fail naming the cause and never reach the line.

`megatron-ba train` and the entry run in this process (NeMo-RL is imported once): the launcher's
exec of `python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced ...` becomes a call of that
module's main with the same arguments. tests/nemorl/test_nemo_rl_slurm.py runs them as the
processes they are, in a Slurm job.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

from preflight_inputs import (
    BENCH,
    PROMPTS_PER_STEP,
    QWEN,
    TRAIN,
    expected_line,
    make_inputs,
    run_env,
    write_bench,
    write_train,
)

from megatron_ba import cli
from megatron_ba.integrations.engines.nemo_rl import ENTRY
from megatron_ba.integrations.nemo_rl import run_grpo_balanced
from megatron_ba.integrations.nemo_rl.nemo_rl_preflight import NEEDS_GPU

pytestmark = pytest.mark.slow


def _train(where: Path, args: list[str], monkeypatch):
    """`megatron-ba train QWEN ARGS` started in `where`, in this process, up to the entry's
    end: its exit status (SystemExit) or exception propagates."""

    def entry_here(executable: str, argv: list[str]) -> None:
        assert argv[1:3] == ENTRY, argv  # the command the launcher would become
        monkeypatch.setattr(sys, "argv", [run_grpo_balanced.__file__, *argv[3:]])
        run_grpo_balanced.main()

    monkeypatch.chdir(where)
    environment = run_env()  # no GPU visible, nothing downloaded, no Ray of the caller's
    for key in [k for k in os.environ if k not in environment]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(os, "execv", entry_here)
    cli.main(["train", str(QWEN), *args, "--run-dir", str(where / "run")])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    where = tmp_path_factory.mktemp("preflight")
    return where, make_inputs(where)


def test_the_entry_checks_config_data_and_reward_then_names_the_gpu_it_needs(
    inputs, monkeypatch, capsys
):
    where, args = inputs
    with pytest.raises(SystemExit) as stop:
        _train(where, args, monkeypatch)
    out = capsys.readouterr()
    assert stop.value.code == NEEDS_GPU == 69, out.out[-3000:] + out.err[-3000:]
    assert "[megatron-ba] checked: BalancedPGLossFn rule=balanced" in out.out
    val = sum(len(rows) for rows in BENCH.values())
    last = out.out.strip().splitlines()[-1]
    assert last == expected_line(len(TRAIN), val, PROMPTS_PER_STEP), last


def test_a_benchmark_file_without_rows_is_named(inputs, tmp_path, monkeypatch, capsys):
    """Negative control: aime25.jsonl empty; the run stops at it, not at the GPU line."""
    _, args = inputs
    bench = write_bench(tmp_path, {**BENCH, "aime25": []})
    write_train(tmp_path)
    args = [a if not a.startswith("eval.data_dir=") else f"eval.data_dir={bench}" for a in args]
    with pytest.raises(ValueError) as refused:
        _train(tmp_path, args, monkeypatch)
    assert str(refused.value) == f"{bench}/aime25.jsonl: no rows (the file is empty)"
    assert "needs CUDA GPUs" not in capsys.readouterr().out


def test_a_ground_truth_the_math_verifier_cannot_match_is_named(
    inputs, tmp_path, monkeypatch, capsys
):
    """Negative control: a two-line ground truth in the scored batch (row 1); dapo_math_verify
    reads one line after `Answer:`, so the right response scores 0 and the run stops naming the
    row, not at the GPU line."""
    _, args = inputs
    rows = [TRAIN[0], ("What are 3 and 4?", "3\n4"), *TRAIN[2:]]
    write_train(tmp_path, rows)
    with pytest.raises(ValueError) as refused:
        _train(tmp_path, args, monkeypatch)
    message = str(refused.value)
    assert message.startswith("data.train row 1: ground truth '3\\n4': "), message
    assert "dapo_math_verify scored the response 'Answer: 3\\n4' 0.0, expected 1.0" in message
    assert "needs CUDA GPUs" not in capsys.readouterr().out
