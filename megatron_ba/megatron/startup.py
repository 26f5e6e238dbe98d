"""megatron-core's world in one call: the process group, the CPU shims, the model-parallel groups
and the model-parallel RNG, in the order megatron-core needs them.

    ctx = setup(ParallelLayout(dp=None), seed=0)   # torchrun's ranks, or a world of one
    ctx = setup(ParallelLayout(tp=2, dp=None), seed=0, backend="gloo", rank=r, world_size=2,
                port=port)                          # dp: what the world leaves
    ...
    teardown()

The lifecycle itself (rendezvous, device binding, groups, DistContext) is
megatron_ba.parallel.world's; this module adds what only the megatron layer knows: on CPU the
shims of cpu_compat go in before megatron-core builds its groups, and the RNG is seeded the CUDA
way (megatron-core's tracker) or the CPU way (cpu_compat.seed_model_parallel_rng).
"""

from __future__ import annotations

import torch

from megatron_ba.errors import UserError
from megatron_ba.megatron import cpu_compat
from megatron_ba.parallel import world
from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout
from megatron_ba.parallel.world import DistContext


def setup(
    layout: ParallelLayout,
    *,
    seed: int,
    names: dict[str, str] = FLAGS,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> DistContext:
    """Join the world (parallel.world.join_world: torchrun's environment, a world of one, or a
    spawned worker with rank / world_size / port), put `layout` on it (its dp: None, or what
    the world leaves), initialise megatron-core's parallel state and seed its model-parallel
    RNG; with CUDA, this process is bound to its GPU first. A layout the world cannot hold is a
    UserError naming the key as `names` spells it (parallel_layout.RECIPE_KEYS for a recipe;
    the commands' FLAGS by default)."""
    device = world.join_world(backend, rank=rank, world_size=world_size, port=port)
    try:
        layout = world.joined_layout(layout)
    except LayoutError as e:
        hint = ""
        if e.key == "world":
            n = layout.model_parallel
            hint = f" (launch with torchrun --nproc-per-node {n} or a multiple of it)"
        raise UserError(e.renamed(names) + hint) from None
    if not torch.cuda.is_available():
        cpu_compat.install()
    world.init_model_parallel(layout)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel  # megatron-core: imported on first use

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.seed_model_parallel_rng(seed)
    return world.world_context(layout, device)


def teardown() -> None:
    """Leave the world that `setup` joined (parallel.world.leave_world)."""
    world.leave_world()
