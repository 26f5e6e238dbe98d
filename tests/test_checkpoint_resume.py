"""Sharded training checkpoints (train/checkpoint.py) resume under another layout, exactly.

    python -m pytest tests/test_checkpoint_resume.py     # 2 gloo launches: TP=2 x DP=2, TP=1

A TP=2 x DP=2 world (4 gloo processes) trains the tiny model 2 GRPO steps with ShardedAdamW, saves a
checkpoint, and records the next step (loss, full gradients, parameters after the update); the
full weights and Adam moments at the save are gathered too. A world of one (TP=1, DP=1) resumes
from it and must hold the same weights and moments bit for bit (dist_checkpointing reshards both)
and repeat the next step to float tolerance. Negative control: the same resume with the model
restored but a fresh optimiser (ONE difference: its Adam state) ends the step elsewhere.

RNG policy: the changed layout reseeds every generator from (seed, step), deterministically and
with a warning; a save and load at the same layout restores the states exactly. A crash in the
middle of a save leaves the previous checkpoint and `latest` intact.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.parallel.world import free_port, spawn

SEED = 11
INIT_SEED = 3
SAVED_STEP = 2
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]


# -- process bodies -----------------------------------------------------------------------
def _setup(rank: int, world: int, port: int, tp: int):
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    from megatron_ba.megatron.startup import setup
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    return setup(ParallelLayout(tp=tp, dp=None), seed=SEED)


def _policy(init_seed: int):
    from megatron_ba.layout_equivalence.cases import tiny_spec
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW
    from megatron_ba.parallel import full_shape

    spec = tiny_spec()
    chunks = mm.build_model_chunks(spec)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, init_seed))
    return spec, chunks, ShardedAdamW(chunks, lr=1e-2, eps=1e-3, clip_grad=0.5, weight_decay=0.1)


def _step(ctx, chunks, opt, step: int) -> dict:
    """One GRPO step on the synthetic batch of `step`: loss, full gradients, norm."""
    from megatron_ba.layout_equivalence.cases import (
        LOSS_CONFIG,
        NUM_GROUPS,
        dp_rows,
        synthetic_batch,
    )
    from megatron_ba.megatron.batching import GRPOBatch
    from megatron_ba.megatron.grpo_step import MicroBatchSpec, forward_backward
    from megatron_ba.parallel.full_shape import gather_full_state_dict
    from megatron_ba.step_settings import StepSettings

    b = synthetic_batch(100 + step)
    rows = dp_rows(b["tokens"].shape[0], ctx.dp, ctx.dp_rank)
    lp = torch.full(b["tokens"].shape, -2.0)
    batch = GRPOBatch(
        tokens=b["tokens"][rows],
        response_mask=b["response_mask"][rows],
        advantages=b["advantages"][rows],
        group_ids=b["group_ids"][rows],
        old_logprobs=lp[rows],
        ref_logprobs=lp[rows] - 0.1,
    )
    settings = StepSettings(AggregationSettings(max_length=16), LOSS_CONFIG)
    result = forward_backward(chunks, batch, settings, MicroBatchSpec(), num_groups=NUM_GROUPS)
    grads = gather_full_state_dict(chunks, grads=True)
    applied, norm = opt.step()
    assert applied
    return {"loss": result.loss, "grads": grads, "norm": norm}


def _full_moments(chunks, opt) -> dict:
    """The Adam moments as full-shape tensors: gathered like gradients (through main_grad,
    which the next step zeroes anyway), with the same TP layout as their parameters."""
    from megatron_ba.parallel.full_shape import gather_full_state_dict

    out = {}
    for name in ("exp_avg", "exp_avg_sq"):
        for p in opt.params:
            p.main_grad.copy_(opt.optimizer.state[p][name])
        out[name] = gather_full_state_dict(chunks, grads=True)
    for p in opt.params:
        p.main_grad.zero_()
    return out


def _state(chunks, opt) -> dict:
    from megatron_ba.parallel.full_shape import gather_full_state_dict

    return {"params": gather_full_state_dict(chunks), **_full_moments(chunks, opt)}


def save_worker(rank: int, world: int, port: int, tp: int, run_dir: str, out: str) -> None:
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, world, port, tp)
    spec, chunks, opt = _policy(INIT_SEED)
    for step in range(SAVED_STEP):
        _step(ctx, chunks, opt, step)
    saved = _state(chunks, opt)
    meta = {"data_position": 8}
    checkpoint.save(ctx, run_dir, SAVED_STEP, chunks, opt, meta, spec=spec)
    nxt = _step(ctx, chunks, opt, SAVED_STEP)
    after = _state(chunks, opt)["params"]
    if rank == 0:
        torch.save({"saved": saved, "next": nxt, "after": after, "steps": opt.step_count()}, out)


def resume_worker(rank: int, port: int, run_dir: str, same_dir: str, out: str) -> None:
    from megatron_ba.conversion import dist_checkpoint as dc
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, 1, port, 1)
    res: dict = {}
    ckpt = checkpoint.latest_dir(run_dir)
    # 1. Changed layout (TP=2 x DP=2 -> TP=1 x DP=1): weights and moments resharded, RNG reseeded.
    _, chunks, opt = _policy(INIT_SEED + 1)  # other weights: the load must replace them
    torch.manual_seed(12345)
    logs: list[str] = []
    meta = checkpoint.load(ctx, ckpt, chunks, opt, seed=SEED, log=logs.append)
    res["meta"], res["logs"] = meta, logs
    res["rng_after_changed"] = torch.rand(4)
    res["resumed"] = _state(chunks, opt)
    res["steps"] = opt.step_count()
    torch.manual_seed(999)  # a second resume lands on the same reseeded streams
    checkpoint.load(ctx, ckpt, chunks, opt, seed=SEED, log=logs.append)
    res["rng_after_changed_again"] = torch.rand(4)
    res["next"] = _step(ctx, chunks, opt, SAVED_STEP)
    res["after"] = _state(chunks, opt)["params"]
    # Negative control: the model restored, the optimiser fresh (no Adam state).
    spec, chunks2, opt2 = _policy(INIT_SEED + 1)
    dc.load_dist_checkpoint(chunks2, ckpt / checkpoint.DIST)  # the model tensors only
    _step(ctx, chunks2, opt2, SAVED_STEP)
    res["after_fresh_optimizer"] = _state(chunks2, opt2)["params"]
    # 2. Same layout (world of one): the per-rank RNG states come back exactly.
    checkpoint.save(ctx, same_dir, 3, chunks, opt, {"data_position": 12}, spec=spec)
    expected = torch.rand(4)
    torch.manual_seed(777)
    logs2: list[str] = []
    checkpoint.load(
        ctx, checkpoint.latest_dir(same_dir), chunks2, opt2, seed=SEED, log=logs2.append
    )
    res["rng_same_layout"] = (torch.equal(torch.rand(4), expected), logs2)
    res["same_layout_state_equal"] = _equal_states(_state(chunks, opt), _state(chunks2, opt2))
    # 3. A crash in the middle of a save (after the tensors are written, before the rename).
    real = dc.save_sharded

    def crash(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("killed mid-save")

    dc.save_sharded = crash
    try:
        checkpoint.save(ctx, same_dir, 4, chunks, opt, {"data_position": 16}, spec=spec)
        res["crash"] = "no error"
    except RuntimeError as e:
        res["crash"] = str(e)
    finally:
        dc.save_sharded = real
    root = os.path.join(same_dir, "checkpoints")
    res["after_crash"] = {
        "latest": checkpoint.latest_dir(same_dir).name,
        "folders": sorted(os.listdir(root)),
    }
    _, chunks3, opt3 = _policy(INIT_SEED + 2)
    checkpoint.load(ctx, checkpoint.latest_dir(same_dir), chunks3, opt3, seed=SEED)
    res["after_crash_loads"] = _equal_states(_state(chunks3, opt3), _state(chunks2, opt2))
    checkpoint.save(ctx, same_dir, 4, chunks, opt, {"data_position": 16}, spec=spec)  # retry
    res["retry_folders"] = sorted(os.listdir(root))
    torch.save(res, out)


def _equal_states(a: dict, b: dict) -> bool:
    return all(
        set(a[k]) == set(b[k]) and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


# -- the test -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    spawn(save_worker, 4, (4, free_port(), 2, str(root / "tp2"), str(root / "tp2.pt")))
    spawn(resume_worker, 1, (free_port(), str(root / "tp2"), str(root / "tp1"), str(root / "r.pt")))
    return torch.load(root / "tp2.pt"), torch.load(root / "r.pt", weights_only=False), root


def test_checkpoint_folder_holds_sharded_tensors_rng_and_meta(runs):
    _, _, root = runs
    ckpt = root / "tp2" / "checkpoints" / "step-000002"
    assert (root / "tp2" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [
        f"rank-{r:05d}.pt" for r in range(4)
    ]
    dist = sorted(p.name for p in (ckpt / "dist").iterdir())
    assert ".metadata" in dist and "megatron_ba_spec.json" in dist
    assert any(n.endswith(".distcp") for n in dist) and not (ckpt / "hf").exists()
    # The non-tensor state: common.pt with megatron-core 0.16.1, an object inside the torch_dist
    # files with 0.19; megatron-core's own reader finds it either way.
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    assert isinstance(load_common_state_dict(str(ckpt / "dist")), dict)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta == {
        "data_position": 8,
        "step": 2,
        "layout": {"tp": 2, "pp": 1, "cp": 1, "dp": 2},
        "world": 4,
    }


def test_resume_at_tp1_dp1_restores_weights_and_moments_exactly(runs):
    saved, res, _ = runs
    assert res["meta"]["step"] == SAVED_STEP and res["meta"]["data_position"] == 8
    assert saved["steps"] == SAVED_STEP + 1 and res["steps"] == SAVED_STEP
    s, r = saved["saved"], res["resumed"]
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert set(s[part]) == set(r[part]) and len(s[part]) > 5
        for name in s[part]:
            assert torch.equal(s[part][name], r[part][name]), (part, name)
        assert any(s[part][n].abs().max() > 0 for n in s[part])  # moments are not the zeros
    # The comparison catches one changed element.
    name = sorted(s["exp_avg"])[0]
    wrong = s["exp_avg"][name].clone().view(-1)
    wrong[0] = wrong[0].nextafter(wrong[0] + 1)
    assert not torch.equal(wrong.view_as(r["exp_avg"][name]), r["exp_avg"][name])


def test_next_step_after_resume_matches_the_uninterrupted_run(runs):
    saved, res, _ = runs
    a, b = saved["next"], res["next"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert b["norm"] == pytest.approx(a["norm"], rel=1e-5)
    for name, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], g, rtol=1e-4, atol=1e-6)
    diff = {n: (res["after"][n] - saved["after"][n]).abs().max().item() for n in saved["after"]}
    assert max(diff.values()) < 1e-5
    # Negative control: a fresh optimiser (no Adam moments) ends the same step elsewhere.
    fresh = res["after_fresh_optimizer"]
    assert max((fresh[n] - saved["after"][n]).abs().max().item() for n in fresh) > 1e-3


def test_rng_reseeded_on_a_changed_layout_restored_on_the_same(runs):
    _, res, _ = runs
    assert torch.equal(res["rng_after_changed"], res["rng_after_changed_again"])
    from megatron_ba.train.checkpoint import reseed_value

    g = torch.Generator().manual_seed(reseed_value(SEED, SAVED_STEP))
    assert torch.equal(res["rng_after_changed"], torch.rand(4, generator=g))  # the documented seed
    assert len(res["logs"]) == 2 and "RNG states are not restored" in res["logs"][0]
    same, logs = res["rng_same_layout"]
    assert same and logs == []  # restored exactly, no warning
    assert res["same_layout_state_equal"]


def test_a_crash_mid_save_leaves_the_previous_checkpoint(runs):
    _, res, _ = runs
    assert res["crash"] == "killed mid-save"
    assert res["after_crash"]["latest"] == "step-000003"
    assert "step-000004" not in res["after_crash"]["folders"]
    assert res["after_crash_loads"]  # the previous checkpoint still loads, whole
    assert res["retry_folders"] == ["latest", "step-000003", "step-000004"]  # leftovers cleared
