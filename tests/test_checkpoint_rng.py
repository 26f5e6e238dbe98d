"""Checkpoint RNG state: a failed save of megatron-core's RNG tracker is an error, not a silent
inexact resume; a checkpoint without that state is refused on load."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


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
