"""The in-memory refit's gathers on gloo processes equal the single-process HF tensors exactly.

Four spawned ranks take TP=2 x PP=2, TP=2 x DP=2 (tied embeddings) and PP=2 x DP=2,
load the same full weights into their shards, and stream the refit (generation/refit.py) into
a sink that records what each engine rank receives; the test compares every bucket against
`hf_named_tensors` of the full state dict in this process (torch.equal: the gathers copy).
Then tiny-qwen3.5 at TP=2 x DP=2 refits an engine that loaded the published
`Qwen3_5ForConditionalGeneration` layout: the Gated DeltaNet's fused in_proj and conv1d gathered
part by part, every name under that layout's `model.language_model.` prefix.
One spawn of four megatron-core processes: slow on 2 shared cores.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

WORLD = 4
LAYOUTS = [  # (tp, pp, tie_word_embeddings)
    (2, 2, False),
    (2, 1, True),  # tied at PP=1 only: megatron-core syncs a tied embedding over PP with CUDA
    (1, 2, False),
]
BUCKET_BYTES = 20_000  # small: several buckets, and tensors larger than one travel alone
SEED = 3


def _worker(rank: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megatron_ba.generation.refit import ReplicaGroups, WeightRefit
    from megatron_ba.megatron import cpu_compat
    from megatron_ba.megatron import model as mm
    from megatron_ba.parallel import collectives, full_shape

    collectives.init_process_group("gloo", rank=rank, world_size=WORLD, port=port)
    cpu_compat.install()
    results = []
    for tp, pp, tie in LAYOUTS:
        parallel_state.initialize_model_parallel(tp, pp)
        cpu_compat.seed_model_parallel_rng(0)
        spec = mm.tiny_qwen2_spec(tie_word_embeddings=tie)
        chunks = mm.build_model_chunks(spec)
        full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, SEED))
        groups = ReplicaGroups.of_this_rank()
        buckets: list = []

        def sink(bucket, buckets=buckets):
            buckets.append([(n, t.clone()) for n, t in bucket])

        refit = WeightRefit(chunks, spec, groups, bucket_bytes=BUCKET_BYTES, dtype=torch.float32)
        sent = refit.stream(sink if groups.is_engine_rank else None)
        results.append(
            {"engine": groups.is_engine_rank, "buckets": buckets, "bytes": sent, "tie": tie}
        )
        parallel_state.destroy_model_parallel()
    results.append(_qwen3_5_conditional(parallel_state, ReplicaGroups, WeightRefit))
    collectives.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def _qwen3_5_spec_and_config():
    """tiny-qwen3.5 (float32, untied) and the config.json of its conditional layout."""
    from megatron_ba.conversion import hf_config_from_spec
    from megatron_ba.layout_equivalence.cases import tiny_spec

    spec = tiny_spec("tiny-qwen3.5")
    return spec, {"model_type": "qwen3_5", "text_config": hf_config_from_spec(spec)}


def _qwen3_5_conditional(parallel_state, ReplicaGroups, WeightRefit) -> dict:
    from megatron_ba.megatron import cpu_compat
    from megatron_ba.megatron import model as mm
    from megatron_ba.parallel import full_shape

    parallel_state.initialize_model_parallel(2, 1)
    cpu_compat.seed_model_parallel_rng(0)
    spec, config = _qwen3_5_spec_and_config()
    chunks = mm.build_model_chunks(spec)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, SEED))
    groups = ReplicaGroups.of_this_rank()
    buckets: list = []
    refit = WeightRefit(
        chunks, spec, groups, bucket_bytes=BUCKET_BYTES, dtype=torch.float32, hf_config=config
    )
    refit.stream(
        (lambda b: buckets.append([(n, t.clone()) for n, t in b]))
        if groups.is_engine_rank
        else None
    )
    parallel_state.destroy_model_parallel()
    return {"engine": groups.is_engine_rank, "buckets": buckets}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path_factory.mktemp("refit")
    spawn(_worker, WORLD, (free_port(), str(out)))
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def _reference(tie: bool, seed: int = SEED) -> list:
    from megatron_ba.conversion import hf_named_tensors
    from megatron_ba.megatron import model as mm

    spec = mm.tiny_qwen2_spec(tie_word_embeddings=tie)
    return list(hf_named_tensors(mm.full_init_state_dict(spec, seed), spec))


@pytest.mark.slow
@pytest.mark.distributed
def test_engine_ranks_are_the_first_rank_of_each_replica(per_rank):
    # megatron-core's order (tp fastest, then dp, then pp): only rank 0 for TP=2 x PP=2, ranks
    # 0 and 2 for TP=2 x DP=2, 0 and 1 for PP=2 x DP=2.
    engines = [[r for r in range(WORLD) if per_rank[r][i]["engine"]] for i in range(len(LAYOUTS))]
    assert engines == [[0], [0, 2], [0, 1]]
    for r in range(WORLD):
        for i in range(len(LAYOUTS)):
            if not per_rank[r][i]["engine"]:
                assert per_rank[r][i]["bytes"] == 0 and per_rank[r][i]["buckets"] == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(LAYOUTS)))
def test_every_engine_receives_exactly_the_single_process_hf_tensors(per_rank, i):
    tie = LAYOUTS[i][2]
    ref = dict(_reference(tie))
    other_seed = dict(_reference(tie, seed=SEED + 1))
    for r in range(WORLD):
        got = per_rank[r][i]
        if not got["engine"]:
            continue
        flat = [(n, t) for b in got["buckets"] for n, t in b]
        names = [n for n, _ in flat]
        assert len(names) == len(set(names)) and set(names) == set(ref)
        assert all(torch.equal(t, ref[n]) for n, t in flat)
        assert not all(torch.equal(t, other_seed[n]) for n, t in flat)  # the check can fail
        assert got["bytes"] == sum(t.numel() * t.element_size() for _, t in flat)
        for b in got["buckets"]:  # bucketed: at most the limit, unless one tensor alone
            size = sum(t.numel() * t.element_size() for _, t in b)
            assert size <= BUCKET_BYTES or len(b) == 1
        assert len(got["buckets"]) > 1
        if tie:
            assert "lm_head.weight" not in names  # the tied copy never travels


@pytest.mark.slow
@pytest.mark.distributed
def test_a_qwen3_5_engine_in_the_conditional_layout_receives_its_names_exactly(per_rank):
    from megatron_ba.conversion import hf_named_tensors
    from megatron_ba.megatron import model as mm

    spec, config = _qwen3_5_spec_and_config()
    full = mm.full_init_state_dict(spec, SEED)
    ref = dict(hf_named_tensors(full, spec, hf_config=config))
    text_layout = {n for n, _ in hf_named_tensors(full, spec)}
    engines = [r for r in range(WORLD) if per_rank[r][len(LAYOUTS)]["engine"]]
    assert engines == [0, 2]
    for r in engines:
        flat = [(n, t) for b in per_rank[r][len(LAYOUTS)]["buckets"] for n, t in b]
        names = [n for n, _ in flat]
        assert len(names) == len(set(names)) and set(names) == set(ref)
        assert all(n.startswith(("model.language_model.", "lm_head.")) for n in names)
        # the layout decided the names (the control): only lm_head is named alike in both
        assert set(names) & text_layout == {"lm_head.weight"}
        assert all(torch.equal(t, ref[n]) for n, t in flat)
        assert any(".linear_attn.in_proj_qkv." in n for n in names)
