"""User errors (errors.UserError: a bad recipe, data set, path or option) reach the terminal as
their message alone, exit status 2, from every command; any other exception keeps its traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import types

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


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
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
            "plan: --lengths, --rewards and --groups need one entry each per sequence, got "
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
