"""Both samplers are generation.engine.Engines; the vLLM one also has the calls train/rollouts.py
makes to refit it and put it to sleep. Structural: no engine is started."""

from __future__ import annotations

import inspect

import pytest

from megatron_ba.generation.builtin_sampler import BuiltinSampler
from megatron_ba.generation.engine import Engine
from megatron_ba.generation.vllm_engine import VLLMEngine

# What train/rollouts.py calls on a replica's engine to refit it and put it to sleep.
REFIT = ("load_bucket", "finish_refit", "sleep", "wake_up")


def _sampler() -> BuiltinSampler:
    return BuiltinSampler(lambda *a: None, eos_token_id=0, pad_token_id=0, decode=str)


def test_builtin_sampler_is_an_engine_and_not_refittable():
    sampler = _sampler()
    assert isinstance(sampler, Engine)
    assert not any(hasattr(sampler, name) for name in REFIT)
    sampler.close()
    with pytest.raises(ValueError, match=r"^first_index: the built-in sampler takes whole"):
        sampler.generate([[1]], n=1, temperature=1.0, max_tokens=1, seed=0, first_index=3)


@pytest.mark.parametrize("cls", [BuiltinSampler, VLLMEngine])
def test_generate_takes_the_protocols_keywords(cls):
    params = inspect.signature(cls.generate).parameters
    assert {"n", "temperature", "max_tokens", "seed", "first_index"} <= set(params)
    assert params["first_index"].default == 0


def test_vllm_engine_has_every_refit_method():
    for name in ("generate", "close", *REFIT):
        assert callable(getattr(VLLMEngine, name)), name
