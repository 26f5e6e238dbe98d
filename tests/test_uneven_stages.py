"""Uneven pipeline stages train, save and resume across splits, exactly.

    python -m pytest tests/test_uneven_stages.py      # 2 gloo launches of 2 processes

The tiny model's 4 layers on PP2 split 1 + 3 (ParallelLayout.pp_first_stage_layers) train 2 GRPO
steps with ShardedAdamW from the same weights as a world of one, and end bit-for-bit near it (each
step's parameters to float tolerance: the split moves no arithmetic, only where it runs). The run
saves a checkpoint (train/checkpoint.py); a PP2 world split 3 + 1 resumes from it and must hold
the same full weights and Adam moments bit for bit (dist_checkpointing reshards by global layer
numbers), then repeat the next step. Negative control: the 3 + 1 world restoring the model alone
(a fresh optimiser, ONE difference) ends the step elsewhere.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from test_checkpoint_resume import _state  # full-shape weights and Adam moments

from megatron_ba.parallel.world import free_port, spawn

SEED, INIT_SEED, STEPS = 11, 3, 2
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]


def _setup(rank: int, world: int, port: int, layout):
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    from megatron_ba.megatron.startup import setup

    return setup(layout, seed=SEED, backend="gloo", rank=rank, world_size=world, port=port)


def _policy(layout, init_seed: int):
    """The tiny model built for `layout`'s stages (its split through the config), its weights
    the full init of `init_seed`, and its optimiser."""
    from megatron_ba.layout_equivalence.cases import tiny_spec
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW
    from megatron_ba.parallel import full_shape

    spec = tiny_spec()
    config = mm.transformer_config(spec, **mm.stage_config_fields(layout))
    chunks = mm.build_model_chunks(spec, config=config)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, init_seed))
    opt = ShardedAdamW(chunks, lr=1e-2, eps=1e-3, clip_grad=0.5, weight_decay=0.1)
    return spec, chunks, opt


def _step(chunks, opt, step: int) -> None:
    """One GRPO step (every rank the whole synthetic batch of `step`: DP is 1 here)."""
    from megatron_ba.layout_equivalence.cases import LOSS_CONFIG, NUM_GROUPS, synthetic_batch
    from megatron_ba.loss_settings import AggregationSettings
    from megatron_ba.megatron.batching import GRPOBatch
    from megatron_ba.megatron.grpo_step import MicroBatchSpec, forward_backward
    from megatron_ba.step_settings import StepSettings

    b = synthetic_batch(100 + step)
    lp = torch.full(b["tokens"].shape, -2.0)
    batch = GRPOBatch(
        tokens=b["tokens"],
        response_mask=b["response_mask"],
        advantages=b["advantages"],
        group_ids=b["group_ids"],
        old_logprobs=lp,
        ref_logprobs=lp - 0.1,
    )
    settings = StepSettings(AggregationSettings(max_length=16), LOSS_CONFIG)
    forward_backward(chunks, batch, settings, MicroBatchSpec(3), num_groups=NUM_GROUPS)
    applied, _ = opt.step()
    assert applied


def _layout(world: int, first: int | None):
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    if world == 1:
        return ParallelLayout(dp=None)
    return ParallelLayout(pp=2, dp=None, pp_first_stage_layers=first)


def train_worker(rank: int, world: int, port: int, first, run_dir: str, out: str) -> None:
    """STEPS steps, a checkpoint, one more step; every state on rank 0 to `out`."""
    from megatron_ba.megatron.startup import teardown
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, world, port, _layout(world, first))
    spec, chunks, opt = _policy(ctx.layout, INIT_SEED)
    built = [layer.layer_number for layer in chunks[0].module.decoder.layers]
    states = []
    for step in range(STEPS):
        _step(chunks, opt, step)
        states.append(_state(chunks, opt)["params"])
    saved = _state(chunks, opt)
    checkpoint.save(ctx, run_dir, STEPS, chunks, opt, {"data_position": 8}, spec=spec)
    _step(chunks, opt, STEPS)
    after = _state(chunks, opt)["params"]
    layers = [None] * world
    torch.distributed.all_gather_object(layers, built)
    if rank == 0:
        torch.save({"steps": states, "saved": saved, "after": after, "layers": layers}, out)
    teardown()


def resume_worker(rank: int, port: int, first: int, run_dir: str, out: str) -> None:
    """The checkpoint of `run_dir` at PP2 split `first` + the rest: restored state, next step;
    the negative control with the model restored and a fresh optimiser."""
    from megatron_ba.conversion import dist_checkpoint as dc
    from megatron_ba.megatron.startup import teardown
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, 2, port, _layout(2, first))
    ckpt = checkpoint.latest_dir(run_dir)
    _, chunks, opt = _policy(ctx.layout, INIT_SEED + 1)  # other weights: the load replaces them
    meta = checkpoint.load(ctx, ckpt, chunks, opt, seed=SEED, log=lambda _: None)
    resumed = _state(chunks, opt)
    _step(chunks, opt, STEPS)
    after = _state(chunks, opt)["params"]
    _, chunks2, opt2 = _policy(ctx.layout, INIT_SEED + 1)
    dc.load_dist_checkpoint(chunks2, ckpt / checkpoint.DIST)
    _step(chunks2, opt2, STEPS)
    fresh = _state(chunks2, opt2)["params"]
    if rank == 0:
        torch.save({"meta": meta, "resumed": resumed, "after": after, "fresh": fresh}, out)
    teardown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    spawn(train_worker, 1, (1, free_port(), None, str(root / "one"), str(root / "one.pt")))
    spawn(train_worker, 2, (2, free_port(), 1, str(root / "pp"), str(root / "pp.pt")))
    spawn(resume_worker, 2, (free_port(), 3, str(root / "pp"), str(root / "resumed.pt")))
    load = lambda name: torch.load(root / name, weights_only=False)  # noqa: E731
    return load("one.pt"), load("pp.pt"), load("resumed.pt")


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b) and len(a) > 5
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_stages_hold_the_split_and_train_as_one_process(runs):
    one, pp, _ = runs
    assert pp["layers"] == [[1], [2, 3, 4]]  # 1 + 3: global layer numbers
    for single, split in zip(one["steps"], pp["steps"], strict=True):
        assert _max_diff(single, split) < 1e-5
    assert _max_diff(one["after"], pp["after"]) < 1e-5
    assert _max_diff(one["steps"][0], one["steps"][1]) > 1e-3  # the steps move the weights


def test_resume_at_another_split_restores_exactly_and_repeats_the_step(runs):
    _, pp, res = runs
    assert res["meta"]["layout"] == {"tp": 1, "pp": 2, "cp": 1, "dp": 1, "pp_first_stage_layers": 1}
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert _max_diff(pp["saved"][part], res["resumed"][part]) == 0.0, part
    assert _max_diff(pp["after"], res["after"]) < 1e-5
    # Negative control: the optimiser's state not restored ends the same step elsewhere.
    assert _max_diff(pp["after"], res["fresh"]) > 1e-3
