"""The CPU optimiser decays what megatron-core's optimiser decays.

ShardedAdamW (CPU) and megatron-core's distributed optimiser (CUDA) must step the same
parameters the same way: megatron-core gives biases and 1-D parameters (norm weights) no weight
decay. One AdamW step with a zero gradient isolates the decay (Adam's update of a zero gradient
is zero): every matrix shrinks by exactly (1 - lr x weight_decay), every bias and norm weight
stays put. An optimiser that decays everything (the control) moves a norm weight.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

LR, WD = 0.1, 0.1


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.fixture
def chunks():
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel import full_shape
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    setup(ParallelLayout(dp=None), seed=0)
    try:
        spec = mm.tiny_qwen2_spec(qk_layernorm=True)  # biases, RMSNorms and q/k norms
        built = mm.build_model_chunks(spec, config=mm.transformer_config(spec))
        full_shape.load_full_state_dict(built, mm.full_init_state_dict(spec, 0))
        yield built
    finally:
        teardown()


def _zero_grad_step(chunks, optimizer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    before = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    for c in chunks:
        for p in c.parameters():
            p.main_grad.zero_()
    applied, norm = optimizer.step()
    assert applied and norm == 0.0
    return {n: (before[n], p.detach()) for c in chunks for n, p in c.named_parameters()}


def test_sharded_adamw_decays_matrices_only(chunks):
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW

    stepped = _zero_grad_step(chunks, ShardedAdamW(chunks, lr=LR, weight_decay=WD))
    kinds = {"matrix": 0, "vector": 0}
    for name, (old, new) in stepped.items():
        if new.dim() >= 2 and not name.endswith(".bias"):
            torch.testing.assert_close(new, old * (1 - LR * WD), rtol=0, atol=1e-7, msg=name)
            kinds["matrix"] += 1
        else:
            assert torch.equal(new, old), f"{name} was decayed"
            kinds["vector"] += 1
    assert kinds["matrix"] > 0 and kinds["vector"] > 0, kinds


def test_the_groups_are_megatron_cores_and_follow_the_learning_rate(chunks):
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW

    optimizer = ShardedAdamW(chunks, lr=LR, weight_decay=WD)
    decays = sorted(g["weight_decay"] for g in optimizer.optimizer.param_groups)
    assert decays == [0.0, WD]
    norms = {
        n
        for c in chunks
        for n, p in c.named_parameters()
        if "layernorm" in n or n.endswith(".bias")
    }
    no_decay = next(g for g in optimizer.optimizer.param_groups if g["weight_decay"] == 0.0)
    assert {id(p) for p in no_decay["params"]} == {
        id(p) for c in chunks for n, p in c.named_parameters() if n in norms
    }
    optimizer.lr = 0.5 * LR  # the schedule sets the base rate; each group runs it x lr_mult
    assert [g["lr"] for g in optimizer.optimizer.param_groups] == [0.5 * LR] * 2
    assert sorted(g["weight_decay"] for g in optimizer.optimizer.param_groups) == [0.0, WD]


def test_control_decaying_every_parameter_moves_a_norm_weight(chunks):
    """Plain torch AdamW over every parameter (the old behaviour) fails the check above."""
    from megatron_ba.megatron.cpu_optimizer import ShardedAdamW

    optimizer = ShardedAdamW(chunks, lr=LR, weight_decay=WD)
    params = [p for c in chunks for p in c.parameters()]
    optimizer.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    stepped = _zero_grad_step(chunks, optimizer)
    moved = [
        n for n, (old, new) in stepped.items() if "layernorm" in n and not torch.equal(old, new)
    ]
    assert moved
