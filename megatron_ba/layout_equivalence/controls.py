"""The layout check's negative controls: the GRPO step with one property broken on purpose.

Each control runs the same prepared step as the exact one (grpo_step.PreparedStep: the same
micro-batches, the same loss function, the same schedule) and differs from
grpo_step.forward_backward in the one property it exposes (a subclass overriding the one method
that holds it, or megatron-core's gradient finalisation wrapped):

  * `scaled_as(version)`: the factor cancels another megatron-core release's scaling
    (loss_scale.loss_scale's rows for that version) instead of the installed one's;
  * `per_microbatch_plan`: each micro-batch's plan is built from that micro-batch's own
    statistics, and the step's loss is the mean over micro-batches and DP ranks of each
    micro-batch's self-normalised loss (NeMo-Aligner's normalisation). Equal to the exact step
    where a micro-batch is the global batch (DP1 x 1 micro-batch); wrong elsewhere.
  * `expert_grads_unreduced`: the exact step, but each rank keeps its own expert gradients:
    scaled by DDP's 1 / (DP x CP) but not summed over the expert-data-parallel group (as if the
    ranks holding the same experts were not data-parallel replicas). Equal to the exact step
    where expert-DP = 1 (every expert on one rank per stage); wrong elsewhere.
  * `sequence_parallel_grads_unreduced`: the exact step, but the parameters sequence
    parallelism marks `sequence_parallel` (the norms' weights, the router's) keep this TP rank's
    gradient, the share of its slice of the sequence, instead of its sum over the TP group.
    Equal to the exact step without sequence parallelism (nothing is marked); wrong under it.
  * `deltanet_norm_grads_unreduced`: the exact step, but the Gated DeltaNet's output norms
    (Qwen3.5) keep this TP rank's heads' share of their weight's gradient instead of its sum over
    TP (what megatron-core's own norm in that place does). Equal to the exact step at tp = 1;
    wrong at tp > 1.

The check must see each control fail wherever its property matters (tests/test_layout_matrix.py).
"""

from __future__ import annotations

from megatron_ba.megatron import grpo_step
from megatron_ba.megatron.grpo_step import PreparedStep, StepResult
from megatron_ba.megatron.loss_scale import loss_scale
from megatron_ba.parallel.full_shape import is_expert_name
from megatron_ba.step_settings import StepSettings


def scaled_as(version: tuple[int, int]):
    """forward_backward, its scale cancelling megatron-core `version`'s factors."""
    return _step_of(_scaled_as(version))


def _scaled_as(version: tuple[int, int]) -> type[PreparedStep]:
    class ScaledAs(PreparedStep):
        def scale(self) -> int:
            view = self.parts.view
            return loss_scale(
                len(self.parts), self.dp, view.cp, per_token_loss=self.per_token_loss,
                version=version,
            )  # fmt: skip

    return ScaledAs


def per_microbatch_plan(version: tuple[int, int] | None = None):
    """forward_backward with each micro-batch's plan from its own statistics (no reduction),
    averaged over micro-batches and DP ranks; `version` as in scaled_as (None: installed)."""
    base = PreparedStep if version is None else _scaled_as(version)

    class PerMicrobatchPlan(base):
        def plan_of(self, settings, num_groups):
            return lambda rows: self.plan(settings, num_groups, rows, reduce=None)

        # The mean over micro-batches and DP ranks; a micro-batch's CP shards still add up to
        # its loss, since its plan comes from whole-sequence lengths.
        def share(self) -> float:
            return 1.0 / (len(self.parts) * self.dp)

        def scale(self) -> float:
            return super().scale() * self.share()

    return _step_of(PerMicrobatchPlan)


def _step_of(cls: type[PreparedStep]):
    """A step function with forward_backward's signature that runs `cls`."""

    def step(chunks, batch, settings: StepSettings, split, *, num_groups, reducer=None):
        return cls.start(chunks, batch, split, reducer).run(settings, num_groups)

    return step


def expert_grads_unreduced(
    chunks, batch, settings: StepSettings, split, *, num_groups, reducer=None
) -> StepResult:
    """forward_backward whose expert gradients skip the expert-data-parallel reduction."""
    from megatron.core.utils import get_model_config

    prepared = PreparedStep.start(chunks, batch, split, reducer)
    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = _experts_kept_local(config.finalize_model_grads_func, chunks)
    return prepared.run(settings, num_groups)


def _experts_kept_local(finalize, chunks):
    """`finalize` (megatron-core's finalize_model_grads), after which every expert parameter's
    gradient is put back to this rank's own, times DDP's 1 / (DP x CP)."""
    from megatron.core import parallel_state

    experts = [
        p for c in chunks for n, p in c.named_parameters() if is_expert_name(n) and p.requires_grad
    ]
    dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)

    def wrapped(*args, **kwargs):
        own = [p.main_grad.detach().clone() for p in experts]
        out = finalize(*args, **kwargs)
        for p, g in zip(experts, own, strict=True):
            p.main_grad.copy_(g / dp_cp)
        return out

    return wrapped


def sequence_parallel_grads_unreduced(
    chunks, batch, settings: StepSettings, split, *, num_groups, reducer=None
) -> StepResult:
    """forward_backward whose sequence-parallel parameters skip the TP all-reduce."""
    from megatron.core.utils import get_model_config

    prepared = PreparedStep.start(chunks, batch, split, reducer)
    config = get_model_config(chunks[0])
    config.finalize_model_grads_func = _sequence_parallel_unmarked(
        config.finalize_model_grads_func, chunks
    )
    return prepared.run(settings, num_groups)


def _sequence_parallel_unmarked(finalize, chunks):
    """`finalize` (megatron-core's finalize_model_grads) run with the `sequence_parallel` marks
    taken off the parameters (so it does not sum their gradients over TP), then put back."""
    marked = [p for c in chunks for p in c.parameters() if getattr(p, "sequence_parallel", False)]

    def wrapped(*args, **kwargs):
        for p in marked:
            p.sequence_parallel = False
        try:
            return finalize(*args, **kwargs)
        finally:
            for p in marked:
                p.sequence_parallel = True

    return wrapped


def deltanet_norm_grads_unreduced(
    chunks, batch, settings: StepSettings, split, *, num_groups, reducer=None
) -> StepResult:
    """forward_backward whose DeltaNet output norms skip their gradient's TP all-reduce."""
    from megatron_ba.megatron.hybrid import HeadSharedRMSNorm

    norms = [m for c in chunks for m in c.modules() if isinstance(m, HeadSharedRMSNorm)]
    for norm in norms:
        norm.sum_grad_over_tp = False
    try:
        return grpo_step.forward_backward(
            chunks, batch, settings, split, num_groups=num_groups, reducer=reducer
        )
    finally:
        for norm in norms:
            norm.sum_grad_over_tp = True
