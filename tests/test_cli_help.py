"""`megatron-ba --help`, every `megatron-ba COMMAND --help` and argument errors import no torch
(nor megatron-core, vLLM, transformers): each runs in a fresh interpreter that then lists what it
imported (sys.modules, not timing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_ba import cli

HEAVY = ("torch", "megatron", "vllm", "transformers")

# Runs the CLI in a fresh interpreter, then lists the heavy top-level packages it imported.
PROBE = f"""
import json, sys
from megatron_ba.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


@pytest.mark.parametrize("command", [None, *cli.COMMANDS])
def test_help_imports_no_torch(command):
    argv = ["--help"] if command is None else [command, "--help"]
    result, out = _probe(*argv)
    assert result == {"code": 0, "heavy": []}, argv
    assert "usage:" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["weights", "--scope", "nope"],
        ["eval", "model", "--benchmarks", "gsm8k"],
        ["compare"],
        ["perf", "nope"],
        ["check-layout", "--rule", "nope"],
    ],
)
def test_argument_errors_import_no_torch(argv):
    result, _ = _probe(*argv)
    assert result == {"code": 2, "heavy": []}, argv


def test_the_probe_sees_torch():
    """The probe is not vacuous: a command that runs imports torch, and it says so."""
    result, _ = _probe("weights")
    assert result["code"] == 0 and "torch" in result["heavy"]
