"""`megatron-ba convert STEP_DIR OUT --to hf` turns a training checkpoint into a Hugging Face
folder, equal bit for bit to the trainer's own export of the same weights.

    python -m pytest tests/test_checkpoint_convert.py    # one spawned save + one convert

A bfloat16 tiny Qwen2 (transformers) is loaded in float32 as the trainer does, its weights moved
off the source (so a conversion that read the source folder would be caught), saved as a
training checkpoint (train/checkpoint.py) and exported directly (the reference, in the source's
dtype like RUN_DIR/hf). The convert command must reproduce the reference from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from megatron_ba.parallel.world import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]


def save_worker(rank: int, port: int, hf_dir: str, run_dir: str, ref_dir: str) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from megatron_ba.conversion import export_chunks_to_hf, load_hf_into_chunks, spec_from_hf_dir
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW
    from megatron_ba.megatron.model import build_model_chunks
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.train import checkpoint

    ctx = setup(ParallelLayout(dp=None), seed=0)
    spec = spec_from_hf_dir(hf_dir, params_dtype=torch.float32)  # the trainer's dtype
    chunks = build_model_chunks(spec)
    load_hf_into_chunks(chunks, hf_dir, spec)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    opt = ShardedAdamW(chunks, lr=1e-3)
    checkpoint.save(
        ctx, run_dir, 1, chunks, opt, {"data_position": 4}, spec=spec, source_dir=hf_dir
    )
    export_chunks_to_hf(chunks, spec, ref_dir, source_dir=hf_dir, dtype=torch.bfloat16)
    teardown()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron_ba.testing.tiny_hf import build_tokenizer
    from tests.test_conversion import build_tiny

    root = tmp_path_factory.mktemp("convert")
    hf = build_tiny(root, "qwen2", dtype=torch.bfloat16)
    build_tokenizer(512).save_pretrained(hf)
    run, ref = root / "run", root / "ref"
    spawn(save_worker, 1, (free_port(), str(hf), str(run), str(ref)))
    return hf, run / "checkpoints" / "step-000001", ref, root


def test_convert_a_training_checkpoint_to_hf(saved):
    from tests.conversion_agreement import compare_folders

    hf, step_dir, ref, root = saved
    out = root / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "convert", str(step_dir), str(out), "--to", "hf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    same = compare_folders(ref, out)
    assert same["same_keys"] and same["num_tensors"] > 5
    assert same["unequal_tensors"] == [] and same["config_diff"] == []
    assert same["side_files_equal"]
    # Negative control: the source folder's weights are not what the checkpoint holds.
    assert len(compare_folders(hf, out)["unequal_tensors"]) == same["num_tensors"]


def test_a_training_checkpoint_needs_to_hf(saved, tmp_path):
    from megatron_ba.commands.convert import _check_args

    _, step_dir, _, _ = saved
    args = argparse.Namespace(src=str(step_dir), out=str(tmp_path / "x"), to="megatron", tp=1, pp=1)
    with pytest.raises(ValueError, match="is a training checkpoint; did you mean --to hf"):
        _check_args(args)
    args.to = "hf"
    _check_args(args)  # accepted


def test_convert_split_over_two_tensor_parallel_ranks_round_trips(tmp_path):
    """The documented `megatron-ba convert --nproc-per-node 2 HF CKPT --tp 2` (torchrun's launcher),
    then `convert CKPT OUT --to hf`: every tensor of OUT equals the source's, bit for bit. (With
    megatron-core's initialisation skipped, the TP=2 load failed on the embedding's shape: the
    partition dims are set by that initialisation.)"""
    from safetensors.torch import load_file

    def run(*argv: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]

    cli = (sys.executable, "-m", "megatron_ba.cli")
    run(*cli, "tiny-model", "hf", "--family", "qwen2")
    run(*cli, "convert", "--nproc-per-node", "2", "hf", "ckpt", "--tp", "2")
    run(*cli, "convert", "ckpt", "back", "--to", "hf")
    source = {
        k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()
    }
    back = {
        k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()
    }
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[k], source[k]) for k in source)
