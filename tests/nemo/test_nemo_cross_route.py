"""The NeMo-Aligner route and the local route are one algorithm: the same rollouts, weights and
settings give the same GRPO loss and gradient through both.

The batch (responses of the tiny model's train prompts, off-policy old log-probs, two groups with
mixed rewards, 3 micro-batches) goes to tests/nemo/nemo_route_update.py (.venv-nemo: our actor in
NeMo-Aligner 0.7.0's `get_loss_and_metrics` on megatron-core 0.10) and to
tests/nemo/local_route_update.py (the main environment: megatron_ba.megatron.grpo_step on
megatron-core 0.16.1), both starting from the tiny model's Hugging Face folder. The main
environment's interpreter is MEGATRON_BA_MAIN_PYTHON (scripts/run_nemo_tests.sh sets it), else
.venv/bin/python. Negative control: NeMo-Aligner's per-micro-batch mean in the NeMo route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_nemo, nemo_env

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
SETTINGS = {"rule": "balanced", "scope": "group", "reg_rule": "token", "reg_scope": "batch",
            "clip_low": 0.2, "clip_high": 0.28, "dual_clip": None, "kl_coef": 0.0,
            "neutral_eps": 0.0, "max_length": None, "temperature": 1.0,
            "num_microbatches": 3}  # fmt: skip


def main_python() -> Path:
    path = Path(os.environ.get("MEGATRON_BA_MAIN_PYTHON", REPO / ".venv" / "bin" / "python"))
    if not path.is_file():
        pytest.fail(f"the main environment's python ({path}): set MEGATRON_BA_MAIN_PYTHON")
    return path


def make_batch(tiny: Path, path: Path) -> None:
    """6 responses to 2 train prompts (3 each), random response tokens of unequal lengths."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "hf")
    rows = [json.loads(x) for x in (tiny / "train.jsonl").read_text().splitlines()[:2]]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows for _ in range(3)]
    g = torch.Generator().manual_seed(3)
    response_lengths = [9, 4, 14, 6, 11, 3]
    seq = max(len(p) + n for p, n in zip(prompts, response_lengths, strict=True))
    tokens = torch.full((6, seq), tok.eos_token_id, dtype=torch.long)
    mask = torch.zeros(6, seq - 1)
    for i, (p, n) in enumerate(zip(prompts, response_lengths, strict=True)):
        tokens[i, : len(p)] = torch.tensor(p)
        tokens[i, len(p) : len(p) + n] = torch.randint(3, len(tok), (n,), generator=g)
        mask[i, len(p) - 1 : len(p) + n - 1] = 1.0  # position j scores token j + 1
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.8, 0.8, -1.6], dtype=torch.float64)
    old = -2.0 + 0.5 * torch.randn(mask.shape, generator=g)
    batch = {"tokens": tokens, "mask": mask, "advantages": advantages,
             "old_logprobs": (old * mask).float(), "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
             "num_groups": 2, "settings": SETTINGS}  # fmt: skip
    torch.save(batch, path)


def run(cmd: list, out: Path) -> dict:
    import torch

    proc = subprocess.run(cmd, env=nemo_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def max_rel(grads: dict, ref: dict) -> float:
    assert grads.keys() == ref.keys(), set(grads) ^ set(ref)
    num = max(float((grads[k].double() - ref[k].double()).abs().max()) for k in ref)
    return num / max(float(ref[k].double().abs().max()) for k in ref)


@pytest.fixture(scope="module")
def routes(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cross_route")
    make_batch(tiny, tmp / "batch.pt")
    args = ["--hf", str(tiny / "hf"), "--batch", str(tmp / "batch.pt")]
    local = run([str(main_python()), str(HERE / "local_route_update.py"), *args,
                 "--out", str(tmp / "local.pt")], tmp / "local.pt")  # fmt: skip
    nemo = run([sys.executable, str(HERE / "nemo_route_update.py"), *args,
                "--out", str(tmp / "nemo.pt")], tmp / "nemo.pt")  # fmt: skip
    control = run([sys.executable, str(HERE / "nemo_route_update.py"), *args,
                   "--out", str(tmp / "control.pt"), "--per-microbatch-mean"],
                  tmp / "control.pt")  # fmt: skip
    return local, nemo, control


def test_one_update_is_the_same_through_both_routes(routes):
    local, nemo, _ = routes
    assert local["loss"] != 0.0
    assert nemo["loss"] == pytest.approx(local["loss"], rel=1e-5, abs=1e-7)
    assert max_rel(nemo["grads"], local["grads"]) < 1e-5


def test_per_microbatch_mean_is_not_the_local_update(routes):
    local, _, control = routes
    assert max_rel(control["grads"], local["grads"]) > 1e-3
