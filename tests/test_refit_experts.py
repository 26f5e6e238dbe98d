"""The in-memory refit under expert parallelism gives every engine every expert, exactly.

    python -m pytest tests/test_refit_experts.py      # one spawn of 2 gloo processes

Two ranks (DP 2 x EP 2: each holds 4 of the 8 experts of every layer, and each is its replica's
engine rank) load the same full tiny-moe weights and stream the refit (generation/refit.py) into
a sink that records what each engine receives; every engine must receive exactly the
single-process Hugging Face tensors (every expert under its global number, torch.equal).
Negative control: the same refit with each rank streaming only its own experts (no gather over
the EP group, the one difference): each engine misses the other rank's 4 experts of each layer.

Measured: 27 s on megatron-core 0.16.1 and 0.19.2 alike, 2 busy cores.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

WORLD = 2
SEED = 3
BUCKET_BYTES = 50_000


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _stream(refit, engine: bool) -> list:
    buckets: list = []

    def sink(bucket):
        buckets.append([(n, t.clone()) for n, t in bucket])

    refit.stream(sink if engine else None)
    return [(n, t) for b in buckets for n, t in b]


def _worker(rank: int, port: int, out_dir: str) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    from megatron_ba.generation.refit import ReplicaGroups, WeightRefit
    from megatron_ba.layout_equivalence.cases import tiny_spec
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.build_options import expert_config_fields
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel import full_shape
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    setup(
        ParallelLayout(ep=2, dp=None),
        seed=0,
        backend="gloo",
        rank=rank,
        world_size=WORLD,
        port=port,
    )
    spec = tiny_spec("tiny-moe")
    config = mm.transformer_config(
        spec, **expert_config_fields(spec, ParallelLayout(ep=2, dp=None))
    )
    chunks = mm.build_model_chunks(spec, config=config)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, SEED))
    groups = ReplicaGroups.of_this_rank()

    class OwnExpertsOnly(WeightRefit):  # the negative control: no gather over the EP group
        def _gathered_experts(self):
            for name, param in self.experts:
                yield name, param.detach().to(self.dtype)

    res = {"engine": groups.is_engine_rank}
    for key, cls in (("refit", WeightRefit), ("own_experts_only", OwnExpertsOnly)):
        refit = cls(chunks, spec, groups, bucket_bytes=BUCKET_BYTES, dtype=torch.float32)
        res[key] = _stream(refit, groups.is_engine_rank)
    teardown()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump(res, f)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path_factory.mktemp("refit-experts")
    spawn(_worker, WORLD, (free_port(), str(out)))
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def _reference() -> dict:
    from megatron_ba.conversion import hf_named_tensors
    from megatron_ba.layout_equivalence.cases import tiny_spec
    from megatron_ba.megatron import model as mm

    spec = tiny_spec("tiny-moe")
    return dict(hf_named_tensors(mm.full_init_state_dict(spec, SEED), spec))


@pytest.mark.slow
@pytest.mark.distributed
def test_every_engine_receives_every_expert_exactly(per_rank):
    ref = _reference()
    experts = [n for n in ref if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3  # 2 layers x 8 experts x (gate, up, down)
    for got in per_rank:
        assert got["engine"]  # DP 2: both ranks are engine ranks
        names = [n for n, _ in got["refit"]]
        assert len(names) == len(set(names)) and set(names) == set(ref)
        assert all(torch.equal(t, ref[n]) for n, t in got["refit"])


@pytest.mark.slow
@pytest.mark.distributed
def test_negative_control_own_experts_only_misses_the_other_half(per_rank):
    ref = _reference()
    for rank, got in enumerate(per_rank):
        names = {n for n, _ in got["own_experts_only"]}
        missing = set(ref) - names
        assert len(missing) == 2 * 4 * 3 and all(".mlp.experts." in n for n in missing)
        mine = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in names if ".experts." in n}
        assert mine == set(range(4 * rank, 4 * rank + 4))
        assert all(torch.equal(t, ref[n]) for n, t in got["own_experts_only"])
