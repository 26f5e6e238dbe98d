"""User errors (errors.UserError: a bad recipe, data set, path or option) reach the terminal as
their message alone, exit status 2, from every command; any other exception keeps its traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_ba import cli
from megatron_ba.data.records import SchemaError
from megatron_ba.errors import UserError


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_reports_a_user_error_alone(command, monkeypatch, capsys):
    module_name = cli.COMMANDS[command][0]

    def run(args):
        raise SchemaError("data.jsonl:3: missing column 'question'")

    fake = types.SimpleNamespace(add_arguments=lambda p: None, run=run)
    monkeypatch.setitem(sys.modules, module_name, fake)
    assert cli.main([command]) == 2
    captured = capsys.readouterr()
    assert captured.err == "data.jsonl:3: missing column 'question'\n" and captured.out == ""


def test_a_bug_keeps_its_traceback(monkeypatch):
    def run(args):
        raise ValueError("an internal invariant broke")

    fake = types.SimpleNamespace(add_arguments=lambda p: None, run=run)
    monkeypatch.setitem(sys.modules, cli.COMMANDS["weights"][0], fake)
    with pytest.raises(ValueError, match="internal invariant"):
        cli.main(["weights"])


ROOT = Path(__file__).resolve().parents[1]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_user_errors_from_real_commands(tmp_path):
    lcb = tmp_path / "lcb.json"
    lcb.write_text(json.dumps([{"title": "A+B", "cases": []}]))  # in neither layout
    model = str(tmp_path)
    cases = [
        (
            ["eval", model, "--benchmarks", "livecodebench", "--source", f"livecodebench={lcb}"],
            "LiveCodeBench lcb.json: record 0: missing column 'question_content'",
        ),
        (
            ["eval", model, "--benchmarks", "math500", "--source", "math500=/no/such.jsonl"],
            "source '/no/such.jsonl': no such file or folder (a hub id is 'org/name')",
        ),
        (
            ["weights", "--lengths", "1,2", "--rewards", "1", "--groups", "0,0"],
            "weights: --lengths, --rewards and --groups need one entry each per sequence, got "
            "--lengths 2, --rewards 1, --groups 2",
        ),
        (["convert", str(tmp_path / "none"), str(tmp_path / "out")], "src: '"),
    ]  # fmt: skip
    for argv, message in cases:
        proc = _cli(*argv)
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), (argv, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_the_project_errors_are_user_errors():
    from megatron_ba.planning.cluster_layout import NoLayoutFits
    from megatron_ba.recipe import RecipeError

    for cls in (SchemaError, RecipeError, NoLayoutFits):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)


def _one_line(proc, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]


def test_cut_short_metrics_files_are_named_by_report(tmp_path):
    """A run's metrics.jsonl.gz cut short, and a metrics.jsonl whose last line was half written:
    `megatron-ba report` names the file (and the line); the untouched copy reports (control)."""
    import gzip
    import shutil

    shipped = ROOT / "docs/testbed/gap-token-means"
    good = tmp_path / "good"
    shutil.copytree(shipped, good, ignore=shutil.ignore_patterns("figures", "report.*"))
    proc = _cli("report", str(good))
    assert proc.returncode == 0, proc.stderr[-2000:]
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    gz = cut / "token-scopebatch-seed0" / "metrics.jsonl.gz"
    gz.write_bytes(gz.read_bytes()[:500])
    _one_line(_cli("report", str(cut)), f"{gz}: cut short or not gz")
    half = tmp_path / "half"
    shutil.copytree(good, half)
    run = half / "token-scopebatch-seed1"
    text = gzip.decompress((run / "metrics.jsonl.gz").read_bytes()).decode()
    (run / "metrics.jsonl.gz").unlink()
    (run / "metrics.jsonl").write_text(text + '{"step": 41, "rew')
    lines = len(text.splitlines())
    _one_line(_cli("report", str(half)), f"{run / 'metrics.jsonl'}: line {lines + 1} is not a JSON")


@pytest.mark.slow
def test_bad_data_files_stop_train_in_one_line_and_leave_no_run_folder(tmp_path):
    """A DAPO-Math-17k .jsonl cut short, and a data file that is not there: `megatron-ba train`
    says which file (and line) in one line, exit 2, and no run folder is left behind."""
    model = tmp_path / "tiny-qwen3"
    assert _cli("tiny-model", str(model)).returncode == 0
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes((ROOT / "tests/fixtures/dapo_math.jsonl").read_bytes()[:300])
    train = ["train", "recipes/tiny-hf-cpu.yaml", f"model.pretrained={model}"]
    for data, message in (
        (cut, f"{cut}: line 1 is not a JSON record"),
        (tmp_path / "none.jsonl", f"source '{tmp_path / 'none.jsonl'}': no such file"),
    ):
        run_dir = tmp_path / f"run-{data.stem}"
        _one_line(_cli(*train, f"data.path={data}", "--run-dir", str(run_dir)), message)
        assert not run_dir.exists()


@pytest.mark.slow
def test_in_several_processes_a_user_error_is_one_line_from_rank_0(tmp_path):
    """`megatron-ba train --nproc-per-node 2`: a bad recipe value (refused before the processes
    meet) and a data file cut short (met by both ranks after they formed their groups) end as rank
    0's one line and exit 2. Control: torchrun itself on the same recipe wraps that line in its
    ChildFailedError report and exits 1, which is why the option exists."""
    tp3 = ["train", "--nproc-per-node", "2", "recipes/tiny-cpu-tp2.yaml", "parallel.tp=3"]
    tp_message = "train: parallel.tp: num_attention_heads=4 is not a multiple of tp=3"
    _one_line(_cli(*tp3), tp_message)
    model = tmp_path / "tiny-qwen3"
    assert _cli("tiny-model", str(model)).returncode == 0
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes((ROOT / "tests/fixtures/dapo_math.jsonl").read_bytes()[:300])
    run_dir = tmp_path / "run"
    train = ["train", "--nproc-per-node", "2", "recipes/tiny-hf-cpu.yaml",
             f"model.pretrained={model}", f"data.path={cut}", f"--run-dir={run_dir}"]  # fmt: skip
    _one_line(_cli(*train), f"{cut}: line 1 is not a JSON record")
    assert not run_dir.exists()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "-m", "megatron_ba.cli", "train", *tp3[3:]]  # fmt: skip
    proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    assert tp_message in proc.stderr


def test_which_failures_of_several_processes_are_user_errors():
    from megatron_ba.parallel.local_launch import user_error_status

    def failed(*ends):  # (exit code, timestamp) per rank, as torch's ProcessFailure holds them
        return {r: types.SimpleNamespace(exitcode=c, timestamp=t, message=f"m{c}")
                for r, (c, t) in enumerate(ends)}  # fmt: skip

    assert user_error_status(failed((2, 5), (2, 5))) == (2, ["m2"])  # every rank says the same
    assert user_error_status(failed((2, 5), (-15, 6))) == (2, ["m2"])  # rank 1 stopped by launcher
    assert user_error_status(failed((2, 5), (1, 5))) == (2, ["m2"])  # rank 1 lost its peer at once
    assert user_error_status(failed((-15, 6), (2, 5))) == (2, ["m2"])  # only rank 1's was seen
    two = failed((2, 5), (2, 5))
    two[1].message = "shard 1 is missing"
    assert user_error_status(two) == (2, ["m2", "rank 1: shard 1 is missing"])
    # a crash came first: torchrun's report
    assert user_error_status(failed((1, 4), (2, 5))) is None
    assert user_error_status(failed((-15, 5), (-9, 5))) is None  # no user error at all
    assert user_error_status(failed((75, 5))) is None


def test_the_launcher_knows_the_trainers_preempted_status():
    from megatron_ba.parallel.local_launch import PREEMPTED_EXIT
    from megatron_ba.train.preemption import PREEMPTED_EXIT_CODE

    assert PREEMPTED_EXIT == PREEMPTED_EXIT_CODE
