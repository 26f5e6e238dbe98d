"""Atomic, resumable checkpoints of a local GRPO run.

    RUN/checkpoints/step-000020/rank-00000.pt   this rank's model shard, optimiser state, RNG
                               /hf/             the whole policy in Hugging Face format (rank 0)
                               /meta.json       step, data position, layout: written last
    RUN/checkpoints/latest                      "step-000020"

A checkpoint is written into a hidden temporary folder and renamed into place only when every
rank's file and the metadata are on disk, so a crash leaves either the previous checkpoint or the
new one, never half of one. `latest` is replaced atomically too. Resuming restores weights,
optimiser moments, the data position and the RNG states, so a resumed run continues with exactly
the state that was saved and logs the same metrics as an uninterrupted run, step for step
(tests/test_train_integration.py checks both).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from megatron_ba.megatron.model import local_to_full_names


def _rng_state() -> dict:
    import numpy as np

    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 - the global state libraries use
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    # megatron-core's model-parallel RNG tracker (dropout and init streams per TP rank). Not
    # guarded: a failed save here would make the resume silently inexact.
    from megatron.core import tensor_parallel

    state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron" not in state:
        raise ValueError("resume: the checkpoint has no megatron RNG tracker state")
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


def model_state(chunks) -> dict[str, torch.Tensor]:
    """This rank's parameters by their full (global) names."""
    return {name: p.detach().clone() for name, (p, _) in local_to_full_names(chunks).items()}


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def save(ctx, run_dir: Path, step: int, chunks, optimizer, meta: dict, hf_export=None) -> Path:
    """Write checkpoint `step` collectively (every rank calls it). Returns its folder."""
    root = Path(run_dir) / "checkpoints"
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    payload = {
        "model": model_state(chunks),
        "optimizer": optimizer.optimizer.state_dict(),
        "rng": _rng_state(),
        "step": step,
    }
    torch.save(payload, tmp / f"rank-{ctx.rank:05d}.pt")
    if hf_export is not None:
        hf_export(tmp / "hf")  # collective gather inside; rank 0 writes
    ctx.barrier()
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / "latest")
    ctx.barrier()
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    root = Path(run_dir) / "checkpoints"
    latest = latest_dir(run_dir)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in steps[: max(0, len(steps) - keep)]:
        if latest is None or p.resolve() != latest.resolve():
            shutil.rmtree(p, ignore_errors=True)


def latest_dir(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def load(ctx, ckpt: Path, chunks, optimizer) -> dict:
    """Restore this rank's shard, optimiser and RNG from `ckpt`; returns its metadata."""
    meta = json.loads((ckpt / "meta.json").read_text())
    layout = meta.get("layout", {})
    here = {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp}
    if layout and layout != here:
        raise ValueError(
            f"resume: checkpoint {ckpt} was written with layout {layout}, this run has {here}"
        )
    payload = torch.load(ckpt / f"rank-{ctx.rank:05d}.pt", weights_only=False)
    names = local_to_full_names(chunks)
    missing = sorted(set(names) - set(payload["model"]))
    if missing:
        raise ValueError(f"resume: checkpoint {ckpt} lacks parameters {missing[:3]}")
    with torch.no_grad():
        for name, (param, _) in names.items():
            param.copy_(payload["model"][name])
    optimizer.optimizer.load_state_dict(payload["optimizer"])
    _set_rng_state(payload["rng"])
    return meta
