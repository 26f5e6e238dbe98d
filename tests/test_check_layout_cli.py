"""`megatron-ba check-layout` as a user runs it: passes, the negative control passes where it
must and fails where it must, impossible layouts are refused.

    python -m pytest tests/test_check_layout_cli.py

The runs launch real gloo processes (1 or 2, plus the single-process reference): ~15-40 s each
on 2 shared cores. The impossible layouts are refused before any launch.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_ba.cli import main

FINAL = re.compile(r"^max_rel_grad_err=(\S+) loss_err=(\S+)$")


def _check_layout(*args: str, exit_code: int) -> tuple[str, float, float]:
    """Run the command; check its exit code and final line; (stdout, grad error, loss error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "check-layout", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    m = FINAL.match(out.strip().splitlines()[-1]) if out.strip() else None
    assert m, out + proc.stderr[-3000:]
    assert proc.returncode == exit_code, out
    return out, float(m.group(1)), float(m.group(2))


@pytest.mark.slow
@pytest.mark.distributed
def test_passes_on_dp2_with_micro_batches():
    out, grad_err, loss_err = _check_layout(
        "--dp", "2", "--micro-batches", "3", "--rule", "balanced", exit_code=0
    )
    assert grad_err <= 1e-5 and loss_err <= 1e-5
    assert "statistics all-reduces per rank: [1, 1]" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_sdpa_attention_at_tp2_matches_the_unfused_single_process_run():
    """The layout under test runs megatron_ba's SDPA core, the reference megatron-core's unfused
    one (tests/test_sdpa_attention.py has the float64 comparison and its controls)."""
    out, grad_err, loss_err = _check_layout(
        "--tp", "2", "--micro-batches", "2", "--attention", "sdpa", exit_code=0
    )
    assert "TP2xPP1xCP1xDP1 (sdpa attention)" in out
    assert grad_err <= 1e-5 and loss_err <= 1e-5


# The control's command; only the layout changes between the passing and the failing run.
CONTROL = ("--rule", "token", "--scope", "batch", "--negative-control")


@pytest.mark.slow
@pytest.mark.distributed
def test_negative_control_passes_where_a_micro_batch_is_the_batch():
    """One DP rank, one micro-batch: per-micro-batch and global normalisation are the same
    thing, so the control (the same loss: clip, dual clip, KL, entropy) must agree exactly."""
    out, grad_err, loss_err = _check_layout(
        "--dp", "1", "--micro-batches", "1", *CONTROL, exit_code=0
    )
    assert grad_err <= 1e-5 and loss_err <= 1e-5
    assert "statistics all-reduces per rank: [0]" in out  # its own statistics: no all-reduce
    assert "PER-MICROBATCH-NORMALISED" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_negative_control_fails():
    """The same command on DP2 x 3 micro-batches: now the normalisation differs."""
    out, grad_err, _ = _check_layout("--dp", "2", "--micro-batches", "3", *CONTROL, exit_code=1)
    assert grad_err > 1e-2  # fails clearly, not by rounding
    assert "statistics all-reduces per rank: [0, 0]" in out
    assert "FAIL: statistics" not in out  # it fails on the gradients alone


@pytest.mark.slow
@pytest.mark.distributed
def test_passes_with_a_token_budget_on_uneven_dp_shards():
    """13 sequences on 2 DP ranks (balanced by tokens), micro-batches of <= 40 tokens each."""
    out, grad_err, loss_err = _check_layout(
        "--dp", "2", "--sequences", "13", "--token-budget", "40", "--rule", "balanced", exit_code=0
    )
    assert "token-budget=40" in out and "PASS" in out
    assert grad_err <= 1e-5 and loss_err <= 1e-5


def test_every_rule_is_a_choice_of_rule(capsys):
    """--rule offers group_token_mean (parsed, then the impossible layout is refused before any
    launch); an unknown rule is argparse's error instead (the control)."""
    assert main(["check-layout", "--rule", "group_token_mean", "--tp", "3"]) == 2
    assert "cannot build layout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["check-layout", "--rule", "group_mean", "--tp", "3"])
    assert "invalid choice: 'group_mean'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "num_attention_heads=4 is not a multiple of tp=3"),
        (["--pp", "3"], "num_layers=4 is not a multiple of pp=3"),
        (["--dp", "13"], "--sequences: 12 is fewer than the 13 DP ranks"),
        (["--dp", "2", "--micro-batches", "7"], "--micro-batches: 7 is more than the 6"),
        (["--sequences", "0"], "--sequences: must be an integer >= 1"),
        (["--token-budget", "8"], "--token-budget: must be an integer >= 16"),
        (["--token-budget", "40", "--micro-batches", "2"], "the token budget decides"),
        (["--cp", "0"], "--cp: must be an integer >= 1"),
        (["--pp", "2", "--pp-first-stage-layers", "4"], "--pp-first-stage-layers: num_layers=4"),
        (["--pp-last-stage-layers", "1"], "--pp-last-stage-layers: needs pp >= 2"),
        (["--pp", "3", "--pp-first-stage-layers", "1"], "leaves 3 layer(s) for the 2 other"),
        (["--sequence-parallel"], "--sequence-parallel: needs tp > 1"),
        (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--sequences", "13"], "do not divide"),
        (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--token-budget", "40"], "--token-budg"),
    ],
)
def test_impossible_layouts_are_refused(args, message, capsys):
    assert main(["check-layout", *args]) == 2
    err = capsys.readouterr().err
    assert "cannot build layout" in err and message in err, err


@pytest.mark.slow
@pytest.mark.distributed
def test_uneven_stages_pass_as_the_user_gives_them():
    out, grad_err, loss_err = _check_layout(
        *("--pp", "2", "--pp-last-stage-layers", "1", "--dp", "2", "--micro-batches", "3"),
        exit_code=0,
    )
    assert "TP1xPP2(last 1)xCP1xDP2" in out and grad_err <= 1e-5 and loss_err <= 1e-5


def test_a_stage_built_other_than_its_layout_says_is_caught(monkeypatch):
    """The check that megatron-core built the layout's split: the layers of an even split, read
    against an uneven layout, are refused (and the uneven split's own are not)."""
    import types

    from megatron.core import parallel_state

    from megatron_ba.layout_equivalence.workers import _check_stage_layers
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    def chunk(numbers):
        layers = [types.SimpleNamespace(layer_number=n) for n in numbers]
        return types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers))

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    uneven = ParallelLayout(pp=2, pp_first_stage_layers=1)
    _check_stage_layers([chunk([2, 3, 4])], uneven, 4)
    with pytest.raises(RuntimeError, match=r"stage 1 built layers \[3, 4\], the layout gives"):
        _check_stage_layers([chunk([3, 4])], uneven, 4)
