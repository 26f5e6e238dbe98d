"""Pure pieces of the rollouts at scale: the prompt split over engines and the weight buckets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.generation.weight_buckets import (
    SharedBucket,
    iter_buckets,
    open_bucket,
    pack,
    unpack,
)
from megatron_ba.train.rollouts import merge_shares, split_evenly


def test_split_by_hand():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(4, 2) == [(0, 2), (2, 4)]
    assert split_evenly(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split_evenly(0, 3) == [(0, 0)] * 3


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 17))
def test_split_then_merge_is_the_identity_and_balanced(count, parts):
    items = [f"prompt-{i}" for i in range(count)]
    bounds = split_evenly(count, parts)
    assert bounds == split_evenly(count, parts)  # deterministic
    sizes = [b - a for a, b in bounds]
    assert sum(sizes) == count and max(sizes) - min(sizes) <= 1
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(parts - 1))  # contiguous, ordered
    shares = [items[a:b] for a, b in bounds]
    assert merge_shares(shares, bounds) == items


def test_merge_rejects_a_share_of_the_wrong_size_and_out_of_order_shares_differ():
    bounds = split_evenly(5, 2)
    with pytest.raises(ValueError, match="share 1 holds 3 items, expected 2"):
        merge_shares([[0, 1, 2], [3, 4, 5]], bounds)
    items = list(range(5))
    shares = [items[a:b] for a, b in bounds]
    # A gather that returned the shares in the wrong order would reorder prompts: caught.
    assert merge_shares(list(reversed(shares)), list(reversed(bounds))) != items
    with pytest.raises(ValueError, match="parts"):
        split_evenly(3, 0)


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g, dtype=torch.float64)),
        ("c", torch.randn(2, 2, generator=g).to(torch.bfloat16)),
        ("d", torch.randint(0, 9, (4,), generator=g)),
    ]


def test_pack_unpack_round_trip_is_exact_for_every_dtype():
    named = _named()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    manifest = pack(named, buffer)
    assert [row[0] for row in manifest] == ["a", "b", "c", "d"]
    assert all(row[3] % 64 == 0 for row in manifest)  # aligned views
    back = unpack(buffer, manifest)
    for (n1, t1), (n2, t2) in zip(named, back, strict=True):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2)
    assert manifest_bytes(manifest) == manifest[-1][3] + 4 * 8
    with pytest.raises(ValueError, match="cannot hold 'b'"):
        pack(named, torch.zeros(70, dtype=torch.uint8))


def test_buckets_keep_order_respect_the_limit_and_isolate_a_large_tensor():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([16, 16, 16, 100, 16])]  # fp32
    buckets = list(iter_buckets(named, limit_bytes=128))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    with pytest.raises(ValueError, match="limit_bytes"):
        list(iter_buckets(named, limit_bytes=0))


def test_shared_bucket_is_seen_through_its_handle_and_removed_on_close():
    named = _named()
    shared = SharedBucket(64, torch.zeros(1).device)  # too small: grows at the first write
    manifest = shared.write(named)
    seen = dict(unpack(open_bucket(shared.handle), manifest))  # as the engine's process maps it
    assert all(torch.equal(seen[n], t) for n, t in named)
    path = shared.path
    shared.write([("a", torch.ones(3, 5))])  # the same segment, rewritten
    assert torch.equal(
        dict(unpack(open_bucket(shared.handle), manifest[:1]))["a"], torch.ones(3, 5)
    )
    shared.close()
    import os

    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="unknown bucket transport"):
        open_bucket({"kind": "file"})


def _recipe(*overrides: str):
    from pathlib import Path

    from megatron_ba.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    return load_recipe(str(root / "tests/fixtures/tiny-train.yaml"), list(overrides))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU errors")
def test_gpu_only_rollout_keys_fail_clearly_on_cpu():
    from megatron_ba.train.engine_setup import check_device_keys

    check_device_keys(_recipe())  # the defaults pass
    with pytest.raises(ValueError, match=r"rollout\.sleep: .*needs CUDA"):
        check_device_keys(_recipe("rollout.sleep=true"))
    with pytest.raises(ValueError, match=r"rollout\.engine_tp: 2 needs CUDA"):
        check_device_keys(_recipe("rollout.engine_tp=2"))


def test_rollout_keys_are_validated():
    from megatron_ba.recipe import RecipeError

    r = _recipe()
    assert (r.rollout.engine_tp, r.rollout.sleep, r.rollout.refit_bucket_mb) == (1, False, 256)
    with pytest.raises(RecipeError, match=r"rollout\.engine_tp: must be >= 1"):
        _recipe("rollout.engine_tp=0")
    with pytest.raises(RecipeError, match=r"rollout\.refit_bucket_mb: must be >= 1"):
        _recipe("rollout.refit_bucket_mb=0")


def test_rollout_dtype_picks_the_engine_and_refit_dtype():
    from megatron_ba.recipe import RecipeError
    from megatron_ba.train.engine_setup import engine_dtype

    auto = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert engine_dtype(_recipe()) == auto
    assert engine_dtype(_recipe("rollout.dtype=bfloat16")) == torch.bfloat16
    assert engine_dtype(_recipe("rollout.dtype=float32")) == torch.float32
    with pytest.raises(RecipeError, match=r"rollout\.dtype: auto, float32 or bfloat16"):
        _recipe("rollout.dtype=fp16")


def manifest_bytes(manifest: list) -> int:
    """Bytes a manifest occupies in its buffer (its last view's end)."""
    if not manifest:
        return 0
    _, shape, dtype, offset = manifest[-1]
    numel = 1
    for s in shape:
        numel *= s
    return offset + numel * getattr(torch, dtype).itemsize
