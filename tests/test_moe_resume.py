"""A mixture-of-experts run saved under expert parallelism resumes at EP1, exactly.

    python -m pytest tests/test_moe_resume.py   # 3 gloo launches: DP2 x EP2, EP1, DP2 x EP1

Two gloo processes (DP 2 x EP 2: each holds 4 of the 8 experts of every layer) train the tiny-moe
model (router aux loss off, untied) 2 GRPO steps with ShardedAdamW (its gradient norm sums the
experts' squares over EP), save a training checkpoint (train/checkpoint.py), and record the next
step. A world of one (EP 1: every expert on one rank) loads it, and so do two processes at
DP 2 x EP 1 (every expert on both, their gradients reduced over expert-DP 2): the weights and
both Adam moments, under global expert numbers, equal the saved ones bit for bit
(dist_checkpointing reshards the experts' global offsets), and the next step repeats the
uninterrupted run's to float tolerance.
Negative control: the same load with the experts' halves exchanged afterwards (each EP rank's
experts put in the other's place, as a loader that took local expert numbers for global ones
would): the weights differ and the next step ends elsewhere.

Measured (`-s` prints it), megatron-core 0.16.1 and 0.19.2 alike: the resumed step's loss equal;
grad norm within 1.0e-10 (EP1) and 2.1e-13 (DP2 x EP1) relative; updated weights within 7.5e-9
and 3.7e-9. The whole file: 26-56 s on 2 shared cores.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS, LayoutError, ParallelLayout
from megatron_ba.parallel.world import free_port, spawn

SEED = 5
INIT_SEED = 3
SAVED_STEP = 2
NUM_EXPERTS = 8
MOMENTS = ("exp_avg", "exp_avg_sq")


# -- process bodies -----------------------------------------------------------------------
# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _setup(rank: int, world: int, port: int, ep: int):
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

    return setup(ParallelLayout(ep=ep, dp=None), seed=SEED)


def _policy(init_seed: int, ep: int):
    from megatron_ba.layout_equivalence.cases import tiny_spec
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.build_options import expert_config_fields
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW
    from megatron_ba.parallel import full_shape

    spec = tiny_spec("tiny-moe")
    layout = ParallelLayout(ep=ep, dp=None)
    config = mm.transformer_config(spec, **expert_config_fields(spec, layout))
    chunks = mm.build_model_chunks(spec, config=config)
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

    b = synthetic_batch(100 + step, model="tiny-moe")
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


def _state(chunks, opt) -> dict:
    """Full-shape weights and Adam moments under global expert numbers (the moments gathered
    like gradients, through main_grad, which the next step zeroes anyway)."""
    from megatron_ba.parallel.full_shape import gather_full_state_dict

    out = {"params": gather_full_state_dict(chunks)}
    for name in MOMENTS:
        for p in opt.params:
            p.main_grad.copy_(opt.optimizer.state[p][name])
        out[name] = gather_full_state_dict(chunks, grads=True)
    for p in opt.params:
        p.main_grad.zero_()
    return out


def save_worker(rank: int, world: int, port: int, run_dir: str, out: str) -> None:
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, world, port, ep=2)
    spec, chunks, opt = _policy(INIT_SEED, ep=2)
    for step in range(SAVED_STEP):
        _step(ctx, chunks, opt, step)
    saved = _state(chunks, opt)
    checkpoint.save(ctx, run_dir, SAVED_STEP, chunks, opt, {"data_position": 8}, spec=spec)
    nxt = _step(ctx, chunks, opt, SAVED_STEP)
    after = _state(chunks, opt)["params"]
    local = sum(1 for n, _ in chunks[0].named_parameters() if ".local_experts." in n)
    if rank == 0:
        torch.save({"saved": saved, "next": nxt, "after": after, "local": local}, out)


def _exchange_expert_halves(chunks, opt) -> None:
    """Negative control: expert j and expert j + 4 of every layer exchange their weights and
    Adam moments (what reading EP rank 1's local experts 0..3 as global 0..3 does); nothing
    else changes."""
    from megatron_ba.parallel.full_shape import LOCAL_EXPERT

    experts = {n: p for c in chunks for n, p in c.named_parameters() if LOCAL_EXPERT.match(n)}
    half = NUM_EXPERTS // 2
    with torch.no_grad():
        for name, a in experts.items():
            head, j, tail = LOCAL_EXPERT.match(name).groups()
            if int(j) >= half:
                continue
            b = experts[f"{head}{int(j) + half}{tail}"]
            tensors = [(a, b)]
            tensors += [(opt.optimizer.state[a][k], opt.optimizer.state[b][k]) for k in MOMENTS]
            for x, y in tensors:
                x_old = x.detach().clone()
                x.copy_(y)
                y.copy_(x_old)


def resume_worker(rank: int, port: int, run_dir: str, out: str) -> None:
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, 1, port, ep=1)
    res: dict = {"layout": ctx.layout.to_dict()}
    ckpt = checkpoint.latest_dir(run_dir)
    _, chunks, opt = _policy(INIT_SEED + 1, ep=1)  # other weights: the load must replace them
    res["meta"] = checkpoint.load(ctx, ckpt, chunks, opt, seed=SEED, log=lambda _: None)
    res["resumed"] = _state(chunks, opt)
    res["next"] = _step(ctx, chunks, opt, SAVED_STEP)
    res["after"] = _state(chunks, opt)["params"]
    # Negative control: the same load, then the experts' halves exchanged.
    _, chunks2, opt2 = _policy(INIT_SEED + 1, ep=1)
    checkpoint.load(ctx, ckpt, chunks2, opt2, seed=SEED, log=lambda _: None)
    _exchange_expert_halves(chunks2, opt2)
    res["permuted"] = _state(chunks2, opt2)
    res["permuted_next"] = _step(ctx, chunks2, opt2, SAVED_STEP)
    res["permuted_after"] = _state(chunks2, opt2)["params"]
    torch.save(res, out)


def resume_dp2_worker(rank: int, world: int, port: int, run_dir: str, out: str) -> None:
    """DP 2 x EP 1: both ranks hold every expert (expert-DP 2: their gradients are reduced)."""
    from megatron_ba.train import checkpoint

    ctx = _setup(rank, world, port, ep=1)
    _, chunks, opt = _policy(INIT_SEED + 1, ep=1)
    checkpoint.load(ctx, checkpoint.latest_dir(run_dir), chunks, opt, seed=SEED, log=lambda _: None)
    res = {"resumed": _state(chunks, opt), "next": _step(ctx, chunks, opt, SAVED_STEP)}
    res["after"] = _state(chunks, opt)["params"]
    if rank == 0:
        torch.save(res, out)


# -- the tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-ckpt")
    spawn(save_worker, 2, (2, free_port(), str(root / "ep2"), str(root / "ep2.pt")))
    spawn(resume_worker, 1, (free_port(), str(root / "ep2"), str(root / "ep1.pt")))
    spawn(resume_dp2_worker, 2, (2, free_port(), str(root / "ep2"), str(root / "dp2.pt")))
    res = torch.load(root / "ep1.pt", weights_only=False)
    res["dp2"] = torch.load(root / "dp2.pt", weights_only=False)
    return torch.load(root / "ep2.pt"), res, root


def _differing(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b)
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


@pytest.mark.distributed
@pytest.mark.slow
def test_saved_under_ep2_the_layout_says_so(runs):
    saved, res, root = runs
    import json

    meta = json.loads((root / "ep2" / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 2, "etp": None}
    assert res["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 1}  # EP1: read as a dense layout
    assert saved["local"] == 2 * 2 * NUM_EXPERTS // 2  # 2 layers x (fc1, fc2) x 4 local experts


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_at_ep1_restores_weights_and_moments_bit_for_bit(runs):
    saved, res, _ = runs
    assert res["meta"]["step"] == SAVED_STEP
    experts = [n for n in saved["saved"]["params"] if ".local_experts." in n]
    assert len(experts) == 2 * 2 * NUM_EXPERTS  # every expert, under its global number
    for part in ("params", "exp_avg", "exp_avg_sq"):
        assert _differing(saved["saved"][part], res["resumed"][part]) == [], part
        assert any(saved["saved"][part][n].abs().max() > 0 for n in experts)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("where", ["ep1", "dp2"])
def test_next_step_after_resume_matches_the_uninterrupted_ep2_run(runs, where):
    saved, res, _ = runs
    res = res if where == "ep1" else res["dp2"]
    for part in ("params", "exp_avg", "exp_avg_sq"):  # DP2 x EP1 loads bit for bit too
        assert _differing(saved["saved"][part], res["resumed"][part]) == [], part
    a, b = saved["next"], res["next"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert b["norm"] == pytest.approx(a["norm"], rel=1e-5)
    for name, g in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], g, rtol=1e-4, atol=1e-6)
    diff = max((res["after"][n] - saved["after"][n]).abs().max().item() for n in saved["after"])
    print(
        f"{where} resume vs EP2: loss rel err {abs(b['loss'] - a['loss']) / abs(a['loss']):.1e}, "
        f"grad norm rel err {abs(b['norm'] - a['norm']) / a['norm']:.1e}, "
        f"updated weights max abs diff {diff:.1e}"
    )
    assert diff < 1e-5


@pytest.mark.distributed
@pytest.mark.slow
def test_negative_control_exchanged_experts_differ_and_step_elsewhere(runs):
    saved, res, _ = runs
    wrong = _differing(saved["saved"]["params"], res["permuted"]["params"])
    assert wrong and all(".local_experts." in n for n in wrong)  # the experts alone moved
    assert len(wrong) == 2 * 2 * NUM_EXPERTS
    after = res["permuted_after"]
    assert max((after[n] - saved["after"][n]).abs().max().item() for n in after) > 1e-3
    assert res["permuted_next"]["loss"] != pytest.approx(saved["next"]["loss"], rel=1e-5)


# -- the recipe's keys (no processes) -----------------------------------------------------
MOE = [
    "model.num_experts=8",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=96",
]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.ep=2"], "parallel.ep"),  # a dense model has no experts
        (["parallel.etp=1"], "parallel.etp"),
        ([*MOE, "parallel.ep=3"], "parallel.ep"),  # 3 does not divide 8
        ([*MOE, "parallel.ep=0"], "parallel.ep"),
        (["model.num_experts=8"], "model.moe_router_topk"),
        ([*MOE, "model.moe_router_topk=9"], "model.moe_router_topk"),
        ([*MOE, "model.moe_ffn_hidden_size=0"], "model.moe_ffn_hidden_size"),
        (["model.moe_ffn_hidden_size=64"], "model.moe_ffn_hidden_size"),
        ([*MOE, "model.moe_aux_loss_coeff=-1"], "model.moe_aux_loss_coeff"),
        (["model.num_experts=-1"], "model.num_experts"),
    ],
)
def test_bad_expert_keys_are_refused_naming_the_key(overrides, key):
    from megatron_ba.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe("recipes/tiny-cpu.yaml", overrides)


def test_the_moe_recipe_loads_and_the_build_refuses_tp_and_bad_etp_by_key():
    from megatron_ba.megatron.model import ModelSpec
    from megatron_ba.model_shape import PRESETS
    from megatron_ba.recipe import load_recipe

    def check(spec, **layout):  # as the trainer's build checks a checkpoint's model
        try:
            ParallelLayout(**layout, dp=None).check_training(spec)
        except LayoutError as e:
            raise ValueError(e.renamed(RECIPE_KEYS)) from None

    r = load_recipe("recipes/tiny-moe-cpu.yaml")
    assert (r.parallel.ep, r.model.num_experts, r.model.moe_router_topk) == (2, 8, 2)
    spec = ModelSpec.of(PRESETS["tiny-moe"])
    check(spec, ep=2)
    with pytest.raises(ValueError, match=r"parallel\.tp"):
        check(spec, tp=2, ep=2)
    # with sequence parallelism (Transformer Engine on GPUs, the local spec on CPU) TP is not
    # refused
    check(spec, tp=2, ep=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"parallel\.etp"):
        check(spec, ep=2, etp=3)
    dense = ModelSpec.of(PRESETS["tiny"])
    with pytest.raises(ValueError, match=r"parallel\.ep"):
        check(dense, ep=2)


def test_nemo_aligner_backend_refuses_expert_parallelism_by_key():
    from megatron_ba.integrations.engines.nemo_aligner import recipe_to_nemo_overrides
    from megatron_ba.recipe import load_recipe

    for override, key in (("parallel.ep=2", "parallel.ep"), ("parallel.etp=1", "parallel.etp")):
        recipe = load_recipe("recipes/tiny-moe-cpu.yaml", ["parallel.ep=1", override])
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            recipe_to_nemo_overrides(recipe)
