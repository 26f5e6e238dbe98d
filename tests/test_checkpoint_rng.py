"""Checkpoint RNG state: a failed save of megatron-core's RNG tracker is an error, not a silent
inexact resume; a checkpoint without that state is refused on load. Pruning keeps the newest
`checkpoint.keep` and the one `latest` names; `latest` never names an incomplete checkpoint."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_a_failing_rng_tracker_save_raises(monkeypatch):
    from megatron.core import tensor_parallel

    from megatron_ba.train import checkpoint

    class Broken:
        def get_states(self):
            raise RuntimeError("tracker unavailable")

    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: Broken())
    with pytest.raises(RuntimeError, match="tracker unavailable"):
        checkpoint._rng_state()


def test_rng_state_round_trips_and_a_missing_tracker_state_is_refused():
    import torch

    from megatron_ba.train import checkpoint

    state = checkpoint._rng_state()
    assert "megatron" in state
    first = torch.rand(3)
    checkpoint._set_rng_state(state)
    assert torch.equal(torch.rand(3), first)  # the restored stream repeats exactly
    del state["megatron"]
    with pytest.raises(ValueError, match="no megatron RNG tracker state"):
        checkpoint._set_rng_state(state)


def _fake_checkpoint(root, step: int, complete: bool = True):
    d = root / "checkpoints" / f"step-{step:06d}"
    (d / "dist").mkdir(parents=True)
    if complete:
        (d / "meta.json").write_text("{}")
    return d


def test_prune_keeps_the_newest_and_never_latest(tmp_path):
    from megatron_ba.train import checkpoint

    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "checkpoints" / "latest").write_text("step-000002\n")  # e.g. after a resume
    checkpoint.prune(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert left == ["step-000002", "step-000003", "step-000004"]  # 1 pruned, latest kept
    assert checkpoint.latest_dir(tmp_path).name == "step-000002"
    assert checkpoint.is_training_checkpoint(checkpoint.latest_dir(tmp_path))


def test_latest_pointing_at_an_incomplete_checkpoint_is_none(tmp_path):
    from megatron_ba.train import checkpoint

    _fake_checkpoint(tmp_path, 5, complete=False)  # no meta.json: never renamed into place
    (tmp_path / "checkpoints" / "latest").write_text("step-000005\n")
    assert checkpoint.latest_dir(tmp_path) is None
    assert not checkpoint.is_training_checkpoint(tmp_path / "checkpoints" / "step-000005")


def test_loading_a_folder_of_the_old_per_rank_format_says_so(tmp_path):
    from megatron_ba.train import checkpoint

    old = tmp_path / "step-000002"
    old.mkdir()
    (old / "meta.json").write_text("{}")
    (old / "rank-00000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"per-rank rank-\*\.pt format of earlier versions"):
        checkpoint.load(None, old, None, None, seed=0)
    (old / "rank-00000.pt").unlink()
    with pytest.raises(ValueError, match=r"lacks meta\.json or its dist/ folder$"):
        checkpoint.load(None, old, None, None, seed=0)
