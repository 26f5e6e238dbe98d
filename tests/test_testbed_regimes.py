"""The aggregation-bias testbed (docs/testbed.md): each regime recipe starts in its intended regime.

Each recipe trains one GRPO step (its warm start, then 32 prompts x 8 samples from the warm-started
policy) and the step's logged statistics are checked: the negative/positive mean-length ratio and
the length variance fall in the regime's range and in no other regime's, and the positive side's
share of the objective weight is its token share under token aggregation and its count share
under BA, computed here by hand from the logged counts and mean lengths (the batch scope, which
pools the batch as those statistics do).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
# The ranges each regime is designed to start in: (low, high) of mean negative length / mean
# positive length, and of the response-length variance (tokens squared). The same code and pins
# gave the variance recipe ratio 1.04 on the machine where the bands were set and 1.165 on a later
# one of the CI's kind (twice, identical: deterministic there; the gap recipe 1.32 and 1.30), most
# likely another CPU's rounding grown over the warm start's 600 steps; the bands leave room for
# that spread and keep a margin between the two regimes.
REGIMES = {
    "variance": {"ratio": (0.85, 1.2), "length_var": (120.0, 400.0)},
    "gap": {"ratio": (1.22, 2.5), "length_var": (30.0, 115.0)},
}


def _in(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory) -> dict[str, dict]:
    """Each regime's step-1 record from `megatron-ba train RECIPE grpo.steps=1`."""
    work = tmp_path_factory.mktemp("testbed")
    out = {}
    for regime in REGIMES:
        run = work / regime
        cmd = [
            sys.executable, "-m", "megatron_ba.cli", "train",
            str(ROOT / f"recipes/testbed-{regime}-cpu.yaml"),
            "grpo.steps=1", "grpo.prompts_per_step=32", "eval.every=0", "data.eval_prompts=16",
            # The logged weight shares then pool the batch, as the logged counts and mean lengths
            # do; step 1's samples are the warm-started policy's whatever the scope.
            "loss.scope=batch",
            "logging.progress=false", "logging.plots=false",
            "--run-dir", str(run), "--cache-dir", str(work / "cache"),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        out[regime] = r = next(r for r in records if r["step"] == 1)
        print(  # the figures docs/testbed.md quotes (pytest -s shows them)
            f"{regime}: accuracy {r['accuracy']:.3f}, mean length + {r['length_mean_pos']:.2f} "
            f"/ - {r['length_mean_neg']:.2f} (ratio {_ratio(r):.3f}), variance "
            f"{r['length_var']:.1f}, positive weight share: token "
            f"{r['token/weight_share_pos']:.3f}, sequence {r['sequence/weight_share_pos']:.3f}, "
            f"balanced {r['balanced/weight_share_pos']:.3f}"
        )
    return out


def _ratio(record: dict) -> float:
    return record["length_mean_neg"] / record["length_mean_pos"]


@pytest.mark.parametrize("regime", REGIMES)
def test_each_regime_starts_in_its_range_and_in_no_other(first_steps, regime):
    record = first_steps[regime]
    measured = {"ratio": _ratio(record), "length_var": record["length_var"]}
    assert record["num_pos"] >= 32 and record["num_neg"] >= 32, record  # both signs present
    for name, ranges in REGIMES.items():
        inside = all(_in(measured[k], ranges[k]) for k in ranges)
        assert inside == (name == regime), (regime, name, measured)


@pytest.mark.parametrize("regime", REGIMES)
def test_token_weights_follow_lengths_and_balanced_weights_follow_counts(first_steps, regime):
    r = first_steps[regime]
    pos_tokens = r["num_pos"] * r["length_mean_pos"]
    neg_tokens = r["num_neg"] * r["length_mean_neg"]
    token_share = pos_tokens / (pos_tokens + neg_tokens)
    count_share = r["num_pos"] / (r["num_pos"] + r["num_neg"])
    assert r["token/weight_share_pos"] == pytest.approx(token_share, rel=1e-9)
    # Pooled BA gives the positive subset |S+| / M of the weight whatever its lengths: the count
    # share. Token gives every token the same weight: the token share.
    assert r["balanced/weight_share_pos"] == pytest.approx(count_share, rel=1e-9)
    if regime == "gap":  # longer wrong answers: token aggregation gives the negatives more
        assert r["token/weight_share_pos"] < count_share - 0.03
