"""Atomic, resumable, layout-independent checkpoints of a local GRPO run.

    RUN/checkpoints/step-000020/dist/          megatron-core dist_checkpointing (torch_dist): the
                                               model's sharded_state_dict and the optimiser's
                                               (Adam moments keyed like the weights, step count),
                                               megatron_ba_spec.json and hf/ (config, tokenizer)
                               /rng/rank-00000.pt   this rank's RNG states
                               /meta.json      step, data position, layout, world, recipe: last
                               /pending_rollouts.pt   the scored batch waiting for its step
                                               (rollout.max_staleness > 0; absent otherwise)
    RUN/checkpoints/latest                     "step-000020"

The tensors are stored with their global offsets, so a checkpoint written at one TP x PP x DP
layout loads at another (dist_checkpointing reshards weights and moments alike); `dist/` is also
a `megatron-ba convert CKPT --to hf` source (the command accepts the step folder itself).

A checkpoint is written into a hidden temporary folder and renamed into place only when every
rank's files and the metadata are on disk, so a crash leaves the previous checkpoint (and
`latest`, replaced atomically too) intact, never half of one.

RNG policy. Per-rank generator states (python, numpy, torch CPU, CUDA when present, megatron-core's
model-parallel tracker) only mean something for the same rank of the same layout. When the
saved layout (the ParallelLayout meta.json records) equals this run's, every rank restores its
own states exactly and the resumed run repeats the uninterrupted one bit for bit
(tests/test_train_integration.py).
Otherwise every generator is reseeded from (recipe seed, step) - the same on every rank, like a
fresh start - and a warning says so; rollouts take their seeds from (seed, step) anyway, so only
streams drawn outside them (dropout, if any) differ from the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch

from megatron_ba.conversion import dist_checkpoint as dc
from megatron_ba.megatron.cpu_compat import seed_model_parallel_rng
from megatron_ba.parallel.parallel_layout import ParallelLayout

DIST = "dist"
RNG = "rng"
PENDING = "pending_rollouts.pt"


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


def reseed_value(seed: int, step: int) -> int:
    """The seed of every generator after a resume under a changed layout (rank-independent)."""
    h = hashlib.sha256(f"{seed}:{step}:resume-rng".encode()).digest()
    return int.from_bytes(h[:4], "big")


def reseed_rng(seed: int, step: int) -> None:
    """Seed python, numpy, torch (CPU and CUDA) and megatron-core's tracker from (seed, step)."""
    import numpy as np

    value = reseed_value(seed, step)
    random.seed(value)
    np.random.seed(value)  # noqa: NPY002
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(value)  # CUDA generators and tracker
    else:
        seed_model_parallel_rng(value)
    torch.manual_seed(value)  # the CPU generator (and every CUDA one) last: one known state


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def saved_layout(meta: dict) -> ParallelLayout | None:
    """The layout a checkpoint's meta.json records (ParallelLayout.to_dict: a run without expert
    parallelism reads as one written before EP existed), or None for a record without one."""
    record = meta.get("layout")
    return None if record is None else ParallelLayout.from_dict(record)


def _sharded_state(chunks, optimizer, *, is_loading: bool = False) -> dict:
    model_sd = dc.model_sharded_state_dict(chunks)
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return {"model": model_sd, "optimizer": opt_sd}


def save(
    ctx,
    run_dir: Path,
    step: int,
    chunks,
    optimizer,
    meta: dict,
    *,
    spec,
    source_dir=None,
    pending: dict | None = None,
) -> Path:
    """Write checkpoint `step` collectively (every rank calls it). Returns its folder.

    `optimizer` offers `sharded_state_dict(model_sharded_sd, is_loading=False)` (megatron-core's
    optimiser signature; `load` passes is_loading=True) and `load_sharded(state)` (ShardedAdamW;
    megatron-core's optimiser on CUDA). `spec` and `source_dir` (the HF folder
    the run started from: config and tokenizer) make `dist/` convertible to Hugging Face.
    `pending` (rank 0): the rollout schedule's batch waiting for its step (plain data).
    """
    root = Path(run_dir) / "checkpoints"
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt's leftovers
        (tmp / RNG).mkdir(parents=True)
    ctx.barrier()
    dc.save_sharded(_sharded_state(chunks, optimizer), tmp / DIST)  # collective
    torch.save(_rng_state(), tmp / RNG / f"rank-{ctx.rank:05d}.pt")
    ctx.barrier()
    if ctx.is_main:
        dc.write_model_meta(tmp / DIST, spec, source_dir)
        full_meta = {**meta, "step": step, "layout": ctx.layout.to_dict(), "world": ctx.world}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2))
        if pending is not None:
            torch.save(pending, tmp / PENDING)
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


def is_training_checkpoint(path: Path) -> bool:
    return (Path(path) / "meta.json").is_file() and (Path(path) / DIST).is_dir()


def load(ctx, ckpt: Path, chunks, optimizer, *, seed: int, log=print) -> dict:
    """Restore weights and optimiser (any layout) and the RNG states (by the module's policy)
    from `ckpt` (collective); returns its metadata."""
    ckpt = Path(ckpt)
    if not is_training_checkpoint(ckpt):
        old = (
            " (the per-rank rank-*.pt format of earlier versions)"
            if any(ckpt.glob("rank-*.pt"))
            else ""
        )
        raise ValueError(f"resume: {str(ckpt)!r} lacks meta.json or its {DIST}/ folder{old}")
    meta = json.loads((ckpt / "meta.json").read_text())
    target = _sharded_state(chunks, optimizer, is_loading=True)
    state = dc.load_sharded(target, ckpt / DIST)
    dc.load_model_state(chunks, state["model"])
    optimizer.load_sharded(state["optimizer"])
    here, saved = ctx.layout, saved_layout(meta)
    if saved == here:
        _set_rng_state(torch.load(ckpt / RNG / f"rank-{ctx.rank:05d}.pt", weights_only=False))
    else:
        reseed_rng(seed, meta["step"])
        if ctx.is_main:
            log(
                f"[resume] warning: layout {saved} -> {here}: the per-rank RNG states are not "
                f"restored; every generator reseeded from (seed {seed}, step {meta['step']})"
            )
    return meta


def load_pending(ckpt: Path) -> dict | None:
    """The batch a checkpoint holds for its next step (rollout.max_staleness > 0), or None."""
    path = Path(ckpt) / PENDING
    return torch.load(path, weights_only=True) if path.is_file() else None
