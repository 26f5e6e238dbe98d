"""`megatron-ba check-layout` as a user runs it: passes, fails for the negative control, refuses
impossible layouts.

    python -m pytest tests/test_check_layout_cli.py

The passing and failing runs launch real gloo processes (2 each, plus the single-process
reference): ~15 s each on 2 cores. The impossible layouts are refused before any launch.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_ba.cli import main

FINAL = re.compile(r"^max_rel_grad_err=(\S+) loss_err=(\S+)$")


def _check_layout(*args: str) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "check-layout", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.returncode, out.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_passes_on_dp2_with_micro_batches():
    rc, out = _check_layout("--dp", "2", "--micro-batches", "3", "--rule", "balanced")
    m = FINAL.match(out.strip().splitlines()[-1])
    assert m, out
    assert rc == 0, out
    assert float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5
    assert "statistics all-reduces per rank: [1, 1]" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_negative_control_fails():
    rc, out = _check_layout(
        "--dp", "2", "--micro-batches", "3", "--rule", "token", "--negative-control"
    )
    m = FINAL.match(out.strip().splitlines()[-1])
    assert m, out
    assert rc == 1, out
    assert float(m.group(1)) > 1e-2  # fails clearly, not by rounding


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "num_attention_heads=4 is not a multiple of tp=3"),
        (["--pp", "3"], "num_layers=4 is not a multiple of pp=3"),
        (["--dp", "5"], "--dp: 5 does not divide the batch's 12 sequences"),
        (["--dp", "2", "--micro-batches", "4"], "--micro-batches: 4 does not divide the 6"),
        (["--cp", "0"], "--cp: must be an integer >= 1"),
    ],
)
def test_impossible_layouts_are_refused(args, message, capsys):
    assert main(["check-layout", *args]) == 2
    err = capsys.readouterr().err
    assert "cannot build layout" in err and message in err, err
