"""The router's auxiliary loss is scaled by megatron-core alone: this project's loss factor never
multiplies it.

    python -m pytest tests/test_moe_aux_loss.py      # one spawned process (~1 min on 2 cores)

megatron-core attaches the load-balancing loss to the router's probabilities
(MoEAuxLossAutoScaler) and scales its backward by `cp / num_microbatches`, set by the schedule
after it has called our loss function (docs/parallelism.md, "Mixture of experts"); DDP then
divides it by DP x CP like every gradient. Our loss function multiplies the GRPO loss by
loss_scale's factor M x DP x CP. The aux loss's gradient contribution (gradient with the aux loss
on minus the same step with it off) must therefore not change when the GRPO loss's factor does:
measured with the factor x1 (the real step), x(1/3) and x10, one process, 3 micro-batches,
tiny-moe with moe_aux_loss_coeff 0.01. The control: the GRPO part of the gradient does scale with
the factor (x10 -> 10 times), so a factor that reached the aux loss would show.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.stack]

FACTORS = (1.0, 1.0 / 3.0, 10.0)


def _grads(aux: float, factor: float, batch) -> dict[str, torch.Tensor]:
    from megatron_ba.layout_equivalence import workers
    from megatron_ba.layout_equivalence.cases import Case, num_groups
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.build_options import resolve_build_options
    from megatron_ba.megatron.grpo_step import MicroBatchSpec, PreparedStep
    from megatron_ba.model_shape import PRESETS
    from megatron_ba.parallel import full_shape

    spec = mm.ModelSpec.of(PRESETS["tiny-moe"], tie_word_embeddings=False, moe_aux_loss_coeff=aux)
    config = mm.transformer_config(spec)
    opts = resolve_build_options(device=torch.device("cpu"))
    chunks = mm.build_model_chunks(spec, config=config, layer_spec=opts.layer_spec(spec, config))
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
    rows = torch.arange(batch["tokens"].shape[0])
    local = workers._local_batch(batch, rows, Case("balanced", 3))
    case = Case("balanced", 3)

    class Scaled(PreparedStep):  # the exact step with its loss scale times `factor`
        def scale(self):
            return super().scale() * factor

    prepared = Scaled.start(chunks, local, MicroBatchSpec(3))
    prepared.run(case.step_settings(), num_groups(batch["tokens"].shape[0]))
    return full_shape.gather_full_state_dict(chunks, grads=True)


def worker(rank: int, port: int, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    from megatron_ba.layout_equivalence.cases import synthetic_batch
    from megatron_ba.layout_equivalence.workers import _build
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    setup(ParallelLayout(dp=None), seed=0, backend="gloo", rank=rank, world_size=1, port=port)
    batch = synthetic_batch(0, model="tiny-moe")
    logp = compute_logprobs(_build(False, 0, ParallelLayout(), "tiny-moe"), batch["tokens"])[0]
    g = torch.Generator().manual_seed(1)
    batch["old_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    batch["ref_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    on = {f: _grads(0.01, f, batch) for f in FACTORS}
    off = {f: _grads(0.0, f, batch) for f in FACTORS}
    router = "decoder.layers.0.mlp.router.weight"
    ref = {k: on[1.0][k] - off[1.0][k] for k in on[1.0]}
    scale = max(float(v.abs().max()) for v in ref.values())
    result = {
        "aux_router_norm": float(ref[router].norm()),
        # max |aux part at factor f - aux part at x1|, over the aux part's max (a factor that
        # reached the aux loss would give |f - 1|) and over the full gradient's max (rounding)
        "aux_change": {
            str(f): max(float((on[f][k] - off[f][k] - ref[k]).abs().max()) for k in ref) / scale
            for f in FACTORS
        },
        "aux_change_vs_full": {
            str(f): max(float((on[f][k] - off[f][k] - ref[k]).abs().max()) for k in ref)
            / max(float(on[f][k].abs().max()) for k in ref)
            for f in FACTORS
        },
        # GRPO part at x10 vs 10 x the GRPO part at x1 (relative): the factor reaches it.
        "grpo_x10_err": max(float((off[10.0][k] - 10 * off[1.0][k]).abs().max()) for k in ref)
        / max(float(10 * off[1.0][k].abs().max()) for k in ref),
        "grpo_x10_vs_x1": max(float((off[10.0][k] - off[1.0][k]).abs().max()) for k in ref),
    }
    teardown()
    with open(out, "w") as f:
        json.dump(result, f)


def test_aux_loss_gradient_is_unchanged_by_the_grpo_loss_factor(tmp_path):
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path / "aux.json"
    spawn(worker, 1, (free_port(), str(out)))
    r = json.loads(out.read_text())
    print(r)
    assert r["aux_router_norm"] > 0  # the aux loss reaches the router
    for factor, change in r["aux_change"].items():
        # float32: the GRPO part is up to ~400x the aux part at x10, so the difference of the
        # two runs carries that part's rounding (measured <= 5.9e-4 of the aux part, <= 1.3e-6 of
        # the gradient); an aux loss scaled by the factor would be off by |f - 1| >= 0.67.
        assert change < 1e-2, (factor, r)
        assert r["aux_change_vs_full"][factor] < 1e-5, (factor, r)
    assert r["grpo_x10_err"] < 1e-5 and r["grpo_x10_vs_x1"] > 0, r
