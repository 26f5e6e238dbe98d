"""`megatron-ba perf step` (perf/step_perf.py) and `perf vocab-parallel --device`: they run,
the two step variants differ in the plan, bad arguments get clear errors (figures: performance.md).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_ba.cli import main

pytest.importorskip("megatron.core")


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_bench_step_runs_both_plans(tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = (
        "perf step --device cpu --sequences 8 --group-size 4 --seq-len 24 --prompt-len 4 "
        f"--micro-batches 2 --repeats 2 --warmup 0 --threads 1 --json {out}"
    ).split()
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "BA / token-mean (medians):" in text
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["dtype"] == "fp32" and d["optimizer"] == "ShardedAdamW"
    assert len(d["ba_times_s"]) == len(d["token_mean_times_s"]) == 2
    assert d["ratio_ba_over_token_mean"] == pytest.approx(
        d["ba_median_s"] / d["token_mean_median_s"]
    )
    assert d["ba_peak_mib"] > 0 and d["token_mean_peak_mib"] > 0
    assert d["tokens_per_step"] == 8 * 24
    # the two variants really aggregate differently: same model and batch, different losses
    assert d["ba_last_loss"] != d["token_mean_last_loss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's errors")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--dtype bf16", "--dtype bf16: needs a CUDA device"),
        ("--recompute full", "--recompute full: needs a CUDA device"),
        ("--sequences 6 --group-size 4", "--sequences 6: not a multiple of --group-size"),
        ("--micro-batches 3", "--micro-batches 3: must divide --sequences"),
        ("--prompt-len 256", "--prompt-len 256: must be in [1, --seq-len)"),
    ],
)
def test_bench_step_errors(extra, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(f"perf step --device cpu {extra}".split())


def test_bench_vocab_parallel_device_flag(tmp_path):
    out = tmp_path / "vp.json"
    argv = (
        "perf vocab-parallel --device cpu --tokens 32 --vocab 64 --tp 2 --rounds 1 "
        f"--chunk-sizes 8 --json {out}"
    ).split()
    assert main(argv) == 0
    d = json.loads(out.read_text())
    assert d["args"]["device"] == "cpu" and d["memory_kind"] == "VmHWM - VmRSS before"
    assert {r["variant"] for r in d["rows"]} == {"naive", "unchunked", "chunked:8"}
    assert max(r["max_abs_diff_vs_naive"] for r in d["rows"]) < 1e-2


def test_in_process_setup_leaves_no_rendezvous_for_children():
    """A world of one set up in this process (as `perf step` does) and torn down must not
    leave RANK / MASTER_PORT behind: children launched later (the convert and train commands of
    other tests) would inherit a rendezvous whose port this process still holds (EADDRINUSE)."""
    import os

    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    if any(k in os.environ for k in keys):
        pytest.skip("this process was launched with a rendezvous of its own")
    setup(ParallelLayout(dp=None), seed=0)
    assert os.environ["RANK"] == "0"  # the world of one's rendezvous, while it lasts
    teardown()
    assert [k for k in keys if k in os.environ] == []
