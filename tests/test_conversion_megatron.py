"""transformers, megatron-core (TP=1 and TP=2 on gloo) and vLLM agree on converted checkpoints.

Tiny random Qwen2 (tied and untied embeddings) and Qwen3 (q/k norms, head_dim 32 != hidden 64 /
4 heads) checkpoints are built with transformers (test_conversion.build_tiny). Each world size
runs in its own launch of tests/conversion_agreement.py (megatron-core's parallel state is global
to a process; a launch costs ~7 s of imports, so one launch checks all three models):

- at TP=1, TP=2 and PP=2 (tied embeddings: PP=1 only, see docs/checkpoints.md), HF ->
  megatron-core log-probs of a fixed sequence equal transformers' (float32, < 1e-5),
  and the two negative controls (gate/up swapped, k/v heads swapped in the fused QKV) do not;
- megatron-core -> HF export is bit-identical: every tensor, dtype and config.json field;
- `megatron-ba convert` HF -> distributed checkpoint (TP=1) -> HF is bit-identical, and the
  checkpoint loads under TP=2 and PP=2 to the same weights as the HF load there;
- vLLM (in-process, float32; one engine for the tied Qwen2 and one for the Qwen3 export) gives
  the same log-probs, also after a weight sync through the trainer's path, and a
  gate/up-swapped sync disagrees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.test_conversion import VARIANTS, build_tiny

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.stack]
AGREE = 1e-5  # two float32 implementations of the same model: measured ~5e-7
DISAGREE = 1e-3  # a wrong conversion: measured >= 1e-2


def _run(args: list[str], timeout: float = 600) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _agreement(*args: str, nproc: int = 1) -> list[str]:
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    return [*launch, "-m", "tests.conversion_agreement", *args]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The checkpoints (with a tokenizer, for vLLM), a dist checkpoint written by the convert
    command at TP=1, and its conversion back to HF."""
    from megatron_ba.testing.tiny_hf import build_tokenizer

    root = tmp_path_factory.mktemp("conversion")
    tok = build_tokenizer(512)
    dirs = {}
    for v in VARIANTS:
        dirs[v] = build_tiny(root, v)
        tok.save_pretrained(dirs[v])
    ckpt, back = root / "dist-qwen3", root / "back-qwen3"
    cli = [sys.executable, "-m", "megatron_ba.cli", "convert"]
    _run([*cli, str(dirs["qwen3"]), str(ckpt)])
    _run([*cli, str(ckpt), str(back), "--to", "hf"])
    return {"root": root, "dirs": dirs, "ckpt": ckpt, "back": back}


def _megatron(work, world: int) -> dict:
    """World 1: TP=1. World 2: TP=2, then PP=2 (one launch), each also loading the dist ckpt."""
    out = work["root"] / f"megatron-world{world}.json"
    dirs = [str(work["dirs"]["qwen3"])] + [str(work["dirs"][v]) for v in VARIANTS[:2]]
    args = [str(out), *dirs, "--export-root", str(work["root"] / "exports")]
    args += ["--layouts", "1x1"] if world == 1 else ["--layouts", "2x1,1x2"]
    if world == 2:
        args += ["--dist-ckpt", str(work["ckpt"])]
    _run(_agreement("megatron", *args, nproc=world))
    return json.loads(out.read_text())["layouts"]


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_matches_transformers_and_exports_bit_identically(work, world):
    layouts = _megatron(work, world)
    assert sorted(layouts) == (["tp1pp1"] if world == 1 else ["tp1pp2", "tp2pp1"])
    checked = 0
    for layout, models in layouts.items():
        assert len(models) == 3
        for name, m in models.items():
            if "skipped" in m:  # only the tied model, only at PP > 1
                assert layout == "tp1pp2" and name.startswith("qwen2-tied")
                continue
            checked += 1
            assert m["megatron_vs_hf_max_abs"] < AGREE, (layout, name)
            assert m["gate_up_swapped_vs_hf_max_abs"] > DISAGREE, (layout, name)  # controls
            assert m["kv_heads_swapped_vs_hf_max_abs"] > DISAGREE, (layout, name)
            e = m["export"]
            assert e["same_keys"] and e["unequal_tensors"] == [], (layout, name)
            assert e["config_diff"] == [] and e["side_files_equal"], (layout, name)
        if world == 2:  # the dist checkpoint written at TP=1 by `megatron-ba convert`
            q3 = models[work["dirs"]["qwen3"].name]
            assert q3["dist_ckpt_equal"] and q3["dist_ckpt_vs_hf_max_abs"] < AGREE
    assert checked == (3 if world == 1 else 5)


def test_convert_command_round_trip_is_bit_identical(work):
    from tests.conversion_agreement import compare_folders

    r = compare_folders(work["dirs"]["qwen3"], work["back"])
    assert r["same_keys"] and r["unequal_tensors"] == [] and r["config_diff"] == []
    assert r["side_files_equal"] and r["num_tensors"] == 25
    assert (work["ckpt"] / "megatron_ba_spec.json").is_file()


def test_convert_command_refuses_bad_arguments(work, tmp_path, capsys):
    """User errors: the message alone on stderr and exit status 2 (megatron_ba.errors)."""
    import re

    from megatron_ba.cli import main

    assert main(["convert", str(work["ckpt"]), str(tmp_path / "x")]) == 2
    assert "did you mean --to hf" in capsys.readouterr().err
    assert main(["convert", str(work["dirs"]["qwen3"]), str(work["ckpt"])]) == 2
    assert re.search(r"out: .* is not empty", capsys.readouterr().err)


@pytest.mark.vllm
def test_vllm_matches_transformers_on_exported_folders(work):
    pytest.importorskip("vllm")
    # Two engine starts (~3 s each, plus vLLM's import): the tied Qwen2 and the Qwen3 export
    # (vLLM's two model classes; the untied head is Qwen2's lm_head path, which
    # test_train_integration's untied warm-start model syncs into vLLM).
    names = [f"{work['dirs'][v].name}-tp2pp1" for v in ("qwen2-tied", "qwen3")]
    dirs = [str(work["root"] / "exports" / n) for n in names]
    if not all(Path(d).is_dir() for d in dirs):
        _megatron(work, 2)  # this test was selected alone
    out = work["root"] / "vllm.json"
    _run(_agreement("vllm", str(out), *dirs, "--sync-root", str(work["root"] / "sync")))
    r = json.loads(out.read_text())["models"]
    assert len(r) == 2
    for name, m in r.items():
        assert m["vllm_vs_hf_max_abs"] < AGREE, name
        assert m["synced_gate_up_swapped_vs_hf_max_abs"] > DISAGREE, name
        assert m["synced_vs_hf_max_abs"] < AGREE, name
