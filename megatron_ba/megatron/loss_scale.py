"""The factor that cancels megatron-core's own loss/gradient normalisation, per version.

Our loss function returns, for each micro-batch (and context-parallel shard) on each data-parallel
rank, its exact share L_part of the global GRPO loss: sum over all parts of L_part = L. The gradient
we want every rank to hold after the step is therefore dL/dtheta = sum_parts dL_part/dtheta.

megatron-core scales what a loss function returns on its way to the gradient. We return the
3-tuple (loss, num_tokens, metrics) that the schedules expect and always report num_tokens = 1
("one unit per micro-batch"), so that every divisor megatron-core applies is a count known before
the step, and multiply the loss by exactly that count:

    loss returned = L_part * loss_scale(M, DP, CP)

Where each factor comes from (megatron-core 0.16.1; M = num_microbatches):

  calculate_per_token_loss = False (default)
    * 1 / num_tokens (= 1) and 1 / M: pipeline_parallel/schedules.py, forward_step_calc_loss:
      `output_tensor /= torch.clamp(num_tokens, min=1); output_tensor /= num_microbatches`.
    * 1 / (DP x CP): distributed/distributed_data_parallel.py, DistributedDataParallel.__init__:
      `gradient_scaling_factor = 1.0 / data_parallel_world_size` with the dp_cp group size
      (or average_in_collective=True: an AVG all-reduce over the same group; the same factor).
      The grad buffers are scaled by it before their SUM all-reduce in finish_grad_sync.
    => loss_scale = M x DP x CP.
  calculate_per_token_loss = True
    * the schedule does not divide (forward_step_calc_loss), DDP's gradient_scaling_factor is 1.0
      (DistributedDataParallel.__init__), and distributed/finalize_model_grads.py,
      finalize_model_grads, divides every gradient by num_tokens summed over the micro-batches,
      broadcast from the last pipeline stage and all-reduced over the dp_cp group:
      `torch.distributed.all_reduce(num_tokens, group=dp_cp_group); scaling = 1.0 / num_tokens`.
      With one unit per micro-batch that total is M x DP x CP.
    => loss_scale = M x DP x CP.

Other versions (read from the sources of the core_r0.10.0 ... core_r0.19.0 branches; only 0.16.1
runs here, so these rows are not exercised by the tests):

  * 0.10, 0.11: forward_step divides by num_tokens *without* the clamp (a 0 would give inf/NaN,
    which our constant 1 avoids); finalize_model_grads all-reduces num_tokens over the DP group
    *without* CP (`parallel_state.get_data_parallel_group()`): per-token scale = M x DP.
  * 0.12: forward_step also multiplies the 3-tuple loss by the CP size
    (`output_tensor *= parallel_state.get_context_parallel_world_size()`), so the default scale is
    M x DP; finalize_model_grads still uses the DP group without CP: per-token scale = M x DP.
  * 0.13 - 0.19: as 0.16.1 (0.19 sums num_tokens over `dp_cp_gtp_remat`, which is dp_cp unless
    that feature is on).
  * The legacy 2-tuple return (loss, metrics) is avoided on purpose: it is divided by M and, from
    0.12 on, multiplied by the CP size (not before), so its CP factor depends on the version.
"""

from __future__ import annotations


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int(minor)


def loss_scale(
    num_microbatches: int,
    dp: int,
    cp: int,
    *,
    per_token_loss: bool,
    version: tuple[int, int] | None = None,
) -> int:
    """The factor our loss is multiplied by so that megatron-core's scaling cancels exactly.

    Assumes the loss function reports num_tokens = 1 per micro-batch (see the module docstring).
    """
    for name, v in (("num_microbatches", num_microbatches), ("dp", dp), ("cp", cp)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
    if version is None:
        version = megatron_core_version()
    if version < (0, 10):
        raise ValueError(
            f"megatron-core {version[0]}.{version[1]}: versions before 0.10 are not supported "
            "(their schedules' loss scaling was not reviewed)"
        )
    if per_token_loss:
        # finalize_model_grads' num_tokens all-reduce: DP only before 0.13, DP x CP from 0.13.
        return num_microbatches * dp * (cp if version >= (0, 13) else 1)
    # forward_step's `*= cp` on the 3-tuple path exists in 0.12 only; DDP divides by DP x CP.
    return num_microbatches * dp * (1 if version == (0, 12) else cp)
