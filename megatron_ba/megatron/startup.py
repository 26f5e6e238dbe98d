"""megatron-core's world in one call: the process group, the CPU shims, the model-parallel groups
and the model-parallel RNG, in the order megatron-core needs them.

    ctx = setup(tp=1, pp=1, cp=1, seed=0)   # torchrun's ranks, or a world of one
    ctx = setup(tp=2, pp=1, cp=1, seed=0, backend="gloo", rank=r, world_size=2, port=port)
    ...
    teardown()

The lifecycle itself (rendezvous, device binding, groups, DistContext) is
megatron_ba.parallel.world's; this module adds what only the megatron layer knows: on CPU the
shims of cpu_compat go in before megatron-core builds its groups, and the RNG is seeded the CUDA
way (megatron-core's tracker) or the CPU way (cpu_compat.seed_model_parallel_rng).
"""

from __future__ import annotations

import torch

from megatron_ba.megatron import cpu_compat
from megatron_ba.parallel import world
from megatron_ba.parallel.world import DistContext


def setup(
    *,
    tp: int,
    pp: int,
    cp: int,
    seed: int,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    expert_keys: tuple[str, str] = ("--ep", "--etp"),
) -> DistContext:
    """Join the world (parallel.world.join_world: torchrun's environment, a world of one, or a
    spawned worker with rank / world_size / port), initialise megatron-core's parallel state
    (`ep`, `etp`: expert and expert-tensor parallelism, carved out of DP x CP) and seed its
    model-parallel RNG; with CUDA, this process is bound to its GPU first. `expert_keys`: how
    the errors name ep and etp (a recipe passes ("parallel.ep", "parallel.etp"))."""
    device = world.join_world(backend, rank=rank, world_size=world_size, port=port)
    world.check_world_divides(tp, pp, cp)
    world.check_expert_layout(tp, pp, cp, ep, etp, expert_keys)
    if not torch.cuda.is_available():
        cpu_compat.install()
    world.init_model_parallel(tp, pp, cp, ep, etp)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel  # megatron-core: imported on first use

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.seed_model_parallel_rng(seed)
    return world.world_context(tp, pp, cp, device, ep, etp)


def teardown() -> None:
    """Leave the world that `setup` joined (parallel.world.leave_world)."""
    world.leave_world()
