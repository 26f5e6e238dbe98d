"""The gloo worker of tests/test_devices_step.py: one world of 2 ranks (CP=2), many checks.

Each check writes its findings into a dict that rank 0 saves; the test asserts on them, so one
spawn (one megatron-core import per rank) serves every check.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

N, S = 4, 16


class DeviceRecorder(TorchDispatchMode):
    """Records the device of every tensor an aten op takes or returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.devices.add(str(t.device))
        return out


def _batch():
    from megatron_ba.megatron.batching import GRPOBatch

    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(N, S, dtype=torch.bool)
    mask[:, 4:] = True
    return GRPOBatch(
        tokens=torch.randint(0, 128, (N, S), generator=g),
        response_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        old_logprobs=torch.zeros(N, S),
    )


def _chunks(spec, *, without_cp: bool = True, **config_overrides):
    from megatron_ba.megatron import model as mm
    from megatron_ba.parallel import full_shape

    config = mm.transformer_config(spec, **config_overrides)
    pgs = mm.model_pg_collection_without_cp() if without_cp else None
    chunks = mm.build_model_chunks(spec, config=config, pg_collection=pgs)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
    return chunks


def _grads(chunks, split):
    from megatron_ba.megatron.grpo_step import forward_backward
    from megatron_ba.parallel.full_shape import gather_full_state_dict
    from megatron_ba.step_settings import StepSettings

    result = forward_backward(chunks, _batch(), StepSettings(), split, num_groups=2)
    return result.loss, gather_full_state_dict(chunks, grads=True)


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def worker(rank: int, world: int, port: int, out: str, root: str) -> None:
    torch.set_num_threads(1)
    from megatron_ba.parallel import collectives

    collectives.init_process_group("gloo", rank=rank, world_size=world, port=port)
    from megatron_ba.megatron import cpu_compat

    cpu_compat.install()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    cpu_compat.seed_model_parallel_rng(0)
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.build_options import resolve_build_options
    from megatron_ba.megatron.grpo_step import MicroBatchSpec
    from megatron_ba.parallel import full_shape
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    found: dict = {}
    spec = mm.tiny_qwen2_spec(num_layers=2)
    cfg = MicroBatchSpec(num_microbatches=2, cp_mode="loss")

    # --- recomputation: the same gradients, and the recompute path really taken -------------
    base_loss, base = _grads(_chunks(spec), cfg)
    calls = {"n": 0}
    original = tensor_parallel.checkpoint

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    tensor_parallel.checkpoint = counting
    try:
        for mode in ("full", "selective"):
            opts = resolve_build_options(
                recompute=mode, device="cpu", layout=ParallelLayout(cp=world)
            )
            calls["n"] = 0
            loss, grads = _grads(_chunks(spec, **opts.config_fields()), cfg)
            found[f"recompute_{mode}"] = {
                "calls": calls["n"],
                "loss_equal": loss == base_loss,
                "max_diff": max(float((grads[k] - base[k]).abs().max()) for k in base),
                "same_names": set(grads) == set(base),
            }
    finally:
        tensor_parallel.checkpoint = original

    # --- bf16 chunks (megatron-core's Float16Module under DDP): names, dtypes, a step --------
    # The bf16 *optimiser* needs CUDA; the model side of bf16 runs on CPU too.
    bf16_opts = resolve_build_options(device="cpu", layout=ParallelLayout(cp=world))
    bf16_fields = {**bf16_opts.config_fields(), "bf16": True, "params_dtype": torch.bfloat16}
    bf16_fields["pipeline_dtype"] = torch.bfloat16
    bf16 = _chunks(spec, **bf16_fields)
    full = full_shape.gather_full_state_dict(bf16)
    init = mm.full_init_state_dict(spec, 0)
    loss16, grads16 = _grads(bf16, cfg)
    found["bf16"] = {
        "wrapper": type(bf16[0].module).__name__,
        "names_equal": set(full) == set(mm.full_parameter_shapes(spec)),
        "dtypes": sorted({str(t.dtype) for t in full.values()}),
        "weights_are_rounded_init": all(
            torch.equal(full[k], init[k].to(torch.bfloat16)) for k in init
        ),
        "loss": loss16,
        "loss_fp32": base_loss,
        "grad_dtypes": sorted({str(p.main_grad.dtype) for p in bf16[0].parameters()}),
        "grads_finite": all(bool(torch.isfinite(t).all()) for t in grads16.values()),
    }

    # --- CP agreement ---------------------------------------------------------------------
    without_cp = _chunks(spec)  # CP group of this rank alone, config CP 1: whole sequences
    sliced = _chunks(spec, without_cp=False)  # real CP group, config CP 1: inconsistent
    # A model that runs CP itself (Transformer Engine on GPUs): the local spec refuses to build
    # one (megatron-core's DotProductAttention asserts context_parallel_size == 1), so a stand-in
    # differs from `sliced` in its config's CP size alone.
    model_cp = _chunks(spec, without_cp=False)
    model_cp[0].module.config.context_parallel_size = world
    found["cp"] = {
        "loss_ok": _error(lambda: mm.check_cp_agreement(without_cp, "loss", world)),
        "model_on_unsharded": _error(lambda: mm.check_cp_agreement(without_cp, "model", world)),
        "inconsistent": _error(lambda: mm.check_cp_agreement(sliced, "loss", world)),
        "cp_model_ok": _error(lambda: mm.check_cp_agreement(model_cp, "model", world)),
        "cp_model_whole": _error(lambda: mm.check_cp_agreement(model_cp, "loss", world)),
        # forward_backward calls the check: a CP model fed whole sequences is refused there.
        "forward_backward": _error(lambda: _grads(model_cp, cfg)),
        "model_cp_size": (mm.model_cp_size(without_cp[0]), mm.model_cp_size(model_cp[0])),
    }

    # --- the local spec's checkpoint keys are the converter's TE spelling ----------------------
    from megatron_ba.conversion.family_table import is_skipped, te_name

    qwen3 = mm.tiny_qwen2_spec(num_layers=2, family="qwen3", qkv_bias=False, qk_layernorm=True)
    chunks3 = _chunks(qwen3)
    local_names = set(full_shape.local_to_full_names(chunks3))
    model3 = chunks3[0].module
    # The checkpoint key of each ShardedTensor (the dict's own keys keep the module names;
    # megatron-core's keys map renames `ShardedTensor.key`, what a checkpoint stores).
    keys = {v.key for v in model3.sharded_state_dict().values() if not is_skipped(v.key)}
    found["te_keys"] = {
        "mcore_keys": sorted(keys),
        "te_names": sorted(te_name(n) for n in local_names),
        "local_names": sorted(local_names),
    }

    # --- a GRPO update through the device parameter: every tensor on ctx.device --------------
    from megatron_ba.generation.engine import Sample
    from megatron_ba.megatron.optimizer_choice import build_optimizer
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.parallel.world import DistContext, rank_device
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.experience import build_experience
    from megatron_ba.train.update import grpo_update

    recipe = load_recipe(
        f"{root}/recipes/tiny-cpu.yaml",
        ["grpo.prompts_per_step=2", "grpo.group_size=2", "parallel.micro_batch_size=2"],
    )
    device = rank_device()
    ctx = DistContext(rank=rank, layout=ParallelLayout(cp=world), dp_rank=0, device=device)
    chunks = _chunks(spec)
    optimizer = build_optimizer(chunks, recipe.optimizer, precision="fp32", device=device)
    g = torch.Generator().manual_seed(2)
    samples = [
        [
            Sample(torch.randint(1, 128, (5 + i + j,), generator=g).tolist(), "", True)
            for j in (0, 1)
        ]
        for i in (0, 1)
    ]
    exp = build_experience([[1, 2, 3], [4, 5]], samples, [1.0, 0.0, 0.0, 1.0], pad_id=0)
    rec = DeviceRecorder()
    with rec:
        metrics = grpo_update(chunks, None, optimizer, recipe.step_settings(), ctx, exp)
    found["device"] = {
        "ctx": str(ctx.device),
        "seen": sorted(rec.devices),
        "applied": metrics["updates_applied"],
    }
    # The recorder's own negative control: one op on another device is seen.
    control = DeviceRecorder()
    with control:
        torch.zeros(2, device="meta") + 1
    found["device"]["control_seen"] = sorted(control.devices)
    if rank == 0:
        torch.save(found, out)
    parallel_state.destroy_model_parallel()
    collectives.destroy_process_group()
