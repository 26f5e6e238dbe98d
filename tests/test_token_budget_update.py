"""train/update.grpo_update under `parallel.max_tokens_per_microbatch` equals the fixed-size
micro-batches: the plan is global, so how the rows are packed must not change the update.

One process (a world of one). The control (the budget path told the longest row, which sets its
micro-batch's width on CPU, is 2 tokens shorter than it is, so the model sees fewer of its
tokens) must differ: the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _update(overrides, *, cut_row: int | None = None):
    from megatron_ba.generation.engine import Sample
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.optimizer_choice import build_optimizer
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel import full_shape
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train import update
    from megatron_ba.train.experience import build_experience

    recipe = load_recipe(
        ROOT / "recipes/tiny-cpu.yaml",
        ["grpo.prompts_per_step=2", "grpo.group_size=3", "parallel.micro_batch_size=2", *overrides],
    )
    ctx = setup(ParallelLayout(dp=None), seed=0)
    try:
        spec = mm.tiny_qwen2_spec()
        chunks = mm.build_model_chunks(spec, config=mm.transformer_config(spec))
        full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
        optimizer = build_optimizer(chunks, recipe.optimizer, precision="fp32", device=ctx.device)
        g = torch.Generator().manual_seed(3)
        samples = [
            [
                Sample(torch.randint(1, 60, (3 + 4 * j + i,), generator=g).tolist(), "", True)
                for j in range(3)
            ]
            for i in range(2)
        ]
        rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        exp = build_experience([[1, 2, 3], [4, 5]], samples, rewards, pad_id=0)
        if cut_row is not None:  # the control: the budget path told a row is shorter than it is
            real = update.response_end

            def short(mask):
                ends = real(mask)
                ends[cut_row] -= 2
                return ends

            update.response_end = short
        try:
            metrics = update.grpo_update(chunks, None, optimizer, recipe.step_settings(), ctx, exp)
        finally:
            if cut_row is not None:
                update.response_end = real
        weights = {k: v.clone() for k, v in full_shape.gather_full_state_dict(chunks).items()}
        return metrics, weights
    finally:
        teardown()


def test_token_budget_update_equals_fixed_micro_batches():
    """Loss, gradient norm (Adam's first step is about lr x sign(grad), so the weights alone
    would hide a scaled gradient) and updated weights agree; the control moves the norm."""
    base_m, base_w = _update([])
    budget_m, budget_w = _update(["parallel.max_tokens_per_microbatch=24"])
    assert budget_m["loss"] == pytest.approx(base_m["loss"], rel=1e-5, abs=1e-7)
    assert budget_m["grad_norm"] == pytest.approx(base_m["grad_norm"], rel=1e-5)
    for name, w in base_w.items():
        torch.testing.assert_close(budget_w[name], w, rtol=1e-5, atol=1e-6, msg=name)
    cut_m, _ = _update(["parallel.max_tokens_per_microbatch=24"], cut_row=5)
    assert cut_m["grad_norm"] != pytest.approx(base_m["grad_norm"], rel=1e-5)
