"""`megatron-ba perf train-lm` (perf/train_lm_perf.py): the synthetic task, the two criteria by
hand, a CPU run whose second run starts from the first's weights (equal losses), and the
comparison's control (the second run at 10 times the learning rate fails it).

The bf16-vs-fp32 tolerance itself needs a GPU (bf16 steps through megatron-core's optimiser,
CUDA only): here both runs are fp32.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ba.megatron.batching import CPView
from megatron_ba.perf import train_lm_perf as train_lm

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = (
    "--device cpu --threads 2 --steps 6 --compare-steps 3 --sequences 4 --seq-len 64 "
    "--micro-batches 2 --data-vocab 256 --block 16 --lr 1e-3 --attention sdpa"
).split()


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_synthetic_tokens_repeat_one_block_per_row():
    args = SimpleNamespace(sequences=3, seq_len=10, block=4, data_vocab=7, seed=0)
    tokens = train_lm.synthetic_tokens(args, vocab_size=100)
    assert tokens.shape == (3, 10) and int(tokens.max()) < 7
    assert torch.equal(tokens[:, 4:8], tokens[:, :4]) and torch.equal(tokens[:, 8:], tokens[:, :2])
    assert not torch.equal(tokens[0, :4], tokens[1, :4])  # each row its own block
    with pytest.raises(SystemExit, match=r"--data-vocab 7: exceeds the vocabulary \(5\)"):
        train_lm.synthetic_tokens(args, vocab_size=5)


def test_microbatches_predict_the_next_token():
    tokens = torch.arange(12).view(4, 3)
    data = train_lm.lm_microbatches(tokens, 2, CPView(causal_mask=True))
    assert len(data) == 2 and data[1]["input_ids"].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert data[0]["targets"].tolist() == [[1, 2, 0], [4, 5, 0]]  # position p predicts p + 1
    assert data[0]["mask"].tolist() == [[True, True, False]] * 2  # the last predicts nothing
    assert data[0]["attention_mask"].shape == (1, 1, 3, 3)


def test_criteria_by_hand():
    # |9 - 9.5| / 9.5 = 0.0526: outside 5 %, inside 6 %.
    assert train_lm.curves_agree([10.0, 9.0], [10.0, 9.5], 0.05)["ok"] is False
    agree = train_lm.curves_agree([10.0, 9.0, 1.0], [10.0, 9.5], 0.06)
    assert agree["ok"] and agree["steps"] == 2
    assert agree["max_rel_diff"] == pytest.approx(0.5 / 9.5)
    assert train_lm.loss_fell([5.0, 4.5, 3.9], 1.0)["ok"]
    fell = train_lm.loss_fell([5.0, 4.2], 1.0)
    assert not fell["ok"] and fell["drop"] == pytest.approx(0.8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--dtype bf16", "--dtype bf16: needs a CUDA device"),
        ("--micro-batches 3", "--micro-batches 3: must divide --sequences"),
        ("--compare-steps 9", "--compare-steps 9: must be in [1, --steps]"),
    ],
)
def test_bad_arguments_are_refused_by_name(extra, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        train_lm.main(f"--device cpu --steps 6 {extra}".split())


def _run(tmp_path, *extra: str):
    out = tmp_path / "lm.json"
    cmd = [sys.executable, "-m", "megatron_ba.cli", "perf", "train-lm", *TINY_RUN, *extra]
    p = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True)
    return p, json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run")
def test_cpu_run_and_the_comparisons_control(tmp_path):
    p, d = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    timed, compare = d["runs"]["timed"], d["runs"]["compare"]
    assert (timed["optimizer"], timed["attention"]) == ("ShardedAdamW", "sdpa")
    assert len(timed["losses"]) == 6 and len(compare["losses"]) == 3
    # The second run starts from the first's weights on the same batch: equal losses, exactly.
    assert compare["losses"] == timed["losses"][:3]
    assert d["precision_comparison"] == {
        "pair": ["fp32", "fp32"],
        "steps": 3,
        "max_rel_diff": 0.0,
        "rel_tol": 0.05,
        "ok": True,
    }
    assert d["loss_fell"]["ok"] and d["loss_fell"]["drop"] >= 1.0
    t = d["throughput"]
    assert t["timed_steps"] == 4 and t["tokens_per_s"] > 0 and t["mfu"] is None  # no GPU peak
    assert t["model_flops_per_step"] > 6 * t["matmul_parameters"] * d["tokens_per_step"]
    # Control: the same comparison with the second run at 10 x the learning rate fails.
    p, d = _run(tmp_path, "--compare-lr", "1e-2")
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    c = d["precision_comparison"]
    assert not c["ok"] and c["max_rel_diff"] > 0.05, c
    assert d["runs"]["compare"]["losses"][0] == d["runs"]["timed"]["losses"][0]  # same start
