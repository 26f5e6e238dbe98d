"""Batch diagnostics (the sign-length coupling made visible) and the `weights` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_ba import group_advantages
from megatron_ba.cli import main
from megatron_ba.diagnostics import batch_diagnostics


def test_diagnostics_hand_computed():
    lengths = torch.tensor([4, 6, 2, 8])
    ids = torch.zeros(4, dtype=torch.long)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), ids, eps=0.0).advantages
    d = batch_diagnostics(lengths, adv, ids)
    assert d["length_mean_pos"] == 3.0 and d["length_mean_neg"] == 7.0
    assert d["length_gap_pos_minus_neg"] == -4.0
    assert d["length_var"] == pytest.approx(5.0)  # population variance of 4, 6, 2, 8
    assert d["token/weight_share_pos"] == pytest.approx(6 / 20)
    assert d["sequence/weight_share_pos"] == pytest.approx(0.5)
    assert d["balanced/weight_share_pos"] == pytest.approx(0.5)
    assert d["token/objective_at_rho1"] == pytest.approx((6 - 14) / 20)
    assert abs(d["balanced/objective_at_rho1"]) < 1e-15
    assert d["zero_adv_fraction"] == 0.0


def test_diagnostics_with_reduce_reports_parts():
    lengths, ids = torch.tensor([4, 6]), torch.tensor([0, 0])
    adv = torch.tensor([1.0, -1.0])
    d = batch_diagnostics(lengths, adv, ids, reduce=lambda t: 2 * t, num_groups=1)
    assert "token/weight_pos_part" in d and "length_var" not in d
    assert d["num_sequences"] == 4.0  # the (simulated) global count


def test_plan_command_prints_all_rules(capsys):
    assert (
        main(["weights", "--lengths", "4,6,2,8", "--rewards", "1,0,1,0", "--groups", "0,0,0,0"])
        == 0
    )
    out = capsys.readouterr().out
    for rule in ("token", "sequence", "dr_grpo", "balanced", "balanced_mass", "group_token_mean"):
        assert rule in out
    assert "positive share of objective weight 0.3000" in out  # token: 6 / 20
    assert main(["nonexistent"]) == 2


def _plan_columns(out: str) -> dict[str, list[float]]:
    """The weight table of `megatron-ba weights`' output, by column name."""
    lines = out.splitlines()
    head = lines[0].split()
    rows = [line.split() for line in lines[1 : lines.index("")]]
    return {name: [float(r[k]) for r in rows] for k, name in enumerate(head)}


def test_plan_command_shows_group_token_mean_per_group_at_the_batch_scope(capsys):
    """The worked example of docs/math.md at --scope batch: group_token_mean stays 1/(2*20) and
    1/(2*6); token, pooled, is 1/26 (the control: the same column code, another rule)."""
    args = ["--lengths", "4,6,2,8,3,3", "--rewards", "1,0,1,0,1,0", "--groups", "0,0,0,0,1,1"]
    assert main(["weights", *args, "--scope", "batch"]) == 0
    columns = _plan_columns(capsys.readouterr().out)
    assert columns["group_token_mean"] == [round(1 / 40, 6)] * 4 + [round(1 / 12, 6)] * 2
    assert columns["token"] == [round(1 / 26, 6)] * 6


def test_console_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "weights" in out and "the former name of `weights`" in out


def test_former_command_names_still_run_and_name_the_new_one(capsys):
    args = ["--lengths", "4,6", "--rewards", "1,0", "--groups", "0,0"]
    assert main(["plan", *args]) == 0
    old = capsys.readouterr()
    assert old.err.startswith("megatron-ba plan: now `megatron-ba weights`")
    assert main(["weights", *args]) == 0
    new = capsys.readouterr()
    assert new.out == old.out and new.err == ""  # the same command, without the note
    with pytest.raises(SystemExit):  # `bench` is `perf`: its measurement names, its errors
        main(["bench", "nosuch"])
    assert "megatron-ba bench: now `megatron-ba perf`" in capsys.readouterr().err
