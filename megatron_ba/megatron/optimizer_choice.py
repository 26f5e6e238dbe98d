"""Which optimiser a run gets, and the GPU one: megatron-core's distributed (ZeRO-1)
mixed-precision Adam.

    optimizer = build_optimizer(chunks, recipe.optimizer, precision="bf16", device=ctx.device)
    optimizer.set_step(step)              # warm-up: megatron-core's OptimizerParamScheduler
    applied, grad_norm = optimizer.step() # megatron-core: grad norm, clipping, Adam, param gather

`build_optimizer` chooses by device and precision (`choose_optimizer`): on the CPU, fp32
parameters and megatron_ba.megatron.cpu_optimizer.ShardedAdamW (megatron-core 0.16.1's optimisers
allocate `device="cuda"` tensors, so they cannot run there); on CUDA, megatron-core's
`get_megatron_optimizer` with bf16 parameters and fp32 main weights, the optimiser state sharded
over the data-parallel group (`use_distributed_optimizer`, ZeRO-1). bf16 on the CPU is an error
naming `model.precision`. fp32 on CUDA also takes megatron-core's distributed optimiser (fp32
parameters are their own main weights; the state is still sharded over DP), so that every CUDA
run has megatron-core's grad norm, clipping and scheduler and none does ShardedAdamW's per-tensor
host reads.

Both optimisers present the same small interface, which megatron_ba.train.policy uses:
`step() -> (applied, grad_norm)`, `lr` (get and set), `set_step(step)`, `state_dict()` /
`load_state_dict()` (and `.optimizer`, the wrapped optimiser whose state a checkpoint saves).

The chunks must be built for the optimiser: bf16 parameters (`model.transformer_config(...,
precision="bf16")`, wrapped by `model.build_model_chunks` in megatron-core's Float16Module) and
DDP with `ddp_config_overrides=ddp_overrides(precision, device)` (the distributed optimiser
needs DDP's buffers laid out for it). The loss scaling of grpo_step is unchanged: with the
distributed optimiser DDP reduce-scatters instead of all-reducing, with the same 1/(DP x CP)
factor.

Weight decay: both optimisers take megatron-core's parameter groups (`_get_param_groups`: no
decay on biases and 1-D parameters such as norm weights), so they decay the same parameters
(tests/test_optimizer_parity.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_ba.megatron.build_options import PRECISIONS
from megatron_ba.megatron.cpu_optimizer import ShardedAdamW

SHARDED_ADAMW, MEGATRON_CORE = "sharded_adamw", "megatron_core"


def choose_optimizer(device: torch.device, precision: str) -> str:
    """Which optimiser runs `precision` on `device`: SHARDED_ADAMW or MEGATRON_CORE."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"model.precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}"
        )
    device = torch.device(device)
    if device.type == "cuda":
        return MEGATRON_CORE
    if precision == "bf16":
        raise ValueError(
            f"model.precision: bf16 needs CUDA (megatron-core's mixed-precision optimiser); "
            f"this rank's device is {device}: use model.precision: fp32"
        )
    return SHARDED_ADAMW


def ddp_overrides(precision: str, device) -> dict[str, Any]:
    """DistributedDataParallelConfig fields for chunks that the optimiser of `precision` on
    `device` steps (see `choose_optimizer`)."""
    if choose_optimizer(device, precision) == MEGATRON_CORE:
        # ZeRO-1: DDP lays its buffers out for the distributed optimiser and reduce-scatters the
        # gradients (fp32 buffers: the main gradients the fp32 main weights step with).
        return {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    return {}


def optimizer_config(opt, *, precision: str):
    """megatron-core OptimizerConfig of the recipe's `optimizer` section (`opt`: lr, weight_decay,
    beta1, beta2, eps, grad_clip)."""
    from megatron.core.optimizer import OptimizerConfig

    bf16 = precision == "bf16"
    return OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.lr,  # constant after the warm-up, as ShardedAdamW's schedule
        weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1,
        adam_beta2=opt.beta2,
        adam_eps=opt.eps,
        # 0 disables clipping in ShardedAdamW; here an infinite threshold does (the clip factor
        # inf / norm > 1 never scales), so that step() still computes and returns the norm.
        clip_grad=opt.grad_clip if opt.grad_clip > 0 else math.inf,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        main_params_dtype=torch.float32,  # fp32 main weights
        main_grads_dtype=torch.float32,
        use_distributed_optimizer=True,  # built only for CUDA runs: ZeRO-1 in either precision
    )


def param_scheduler(optimizer, opt):
    """megatron-core's OptimizerParamScheduler: linear warm-up from 0 over `opt.warmup_steps`
    steps, then constant `opt.lr`; constant weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = int(opt.warmup_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt.lr,
        min_lr=opt.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + 1,  # must exceed the warm-up; "constant" never decays
        lr_decay_style="constant",
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def set_scheduler_step(scheduler, step: int) -> None:
    """The learning rate of optimiser step `step` (0-based): (step + 1) / warmup of the peak
    during the warm-up, as ShardedAdamW's schedule in policy.set_lr."""
    scheduler.num_steps = int(step)
    scheduler.step(1)


class MegatronCoreAdamW:
    """megatron-core's optimiser (from `get_megatron_optimizer`) behind ShardedAdamW's interface."""

    def __init__(self, chunks: list[torch.nn.Module], opt, *, precision: str = "bf16") -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        if not (opt.lr >= 0 and math.isfinite(opt.lr)):
            raise ValueError(f"optimizer.lr: must be a finite number >= 0, got {opt.lr!r}")
        self.config = optimizer_config(opt, precision=precision)
        self.optimizer = get_megatron_optimizer(self.config, chunks)
        self.scheduler = param_scheduler(self.optimizer, opt)

    def step(self) -> tuple[bool, float]:
        """Unscale/check, clip by the global norm, step, gather the bf16 params (megatron-core).
        Returns (applied, norm of the gradient before clipping)."""
        applied, grad_norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()
        # A found inf/NaN skips the step and returns no norm.
        return bool(applied), float("nan") if grad_norm is None else float(grad_norm)

    def zero_grad(self) -> None:
        """As ShardedAdamW's (step() already zeroes; a caller may also ask)."""
        self.optimizer.zero_grad()

    def set_step(self, step: int) -> None:
        set_scheduler_step(self.scheduler, step)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The distributed optimiser's state for megatron-core dist_checkpointing (each rank's
        shard of the fp32 main weights and Adam moments) and the LR scheduler's counters, in the
        interface train/checkpoint.py calls (ShardedAdamW's): `is_loading=True` builds the
        target of a load, as megatron-core's own checkpointing does."""
        return {
            "optimizer": self.optimizer.sharded_state_dict(
                model_sharded_state_dict, is_loading=is_loading
            ),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_sharded(self, state: dict) -> None:
        """Restore what `sharded_state_dict` saved, as returned by dist_checkpointing.load."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def apply_lr_schedule(optimizer, step: int, *, lr: float, warmup_steps: int) -> None:
    """The learning rate of optimiser step `step` (0-based): linear warm-up over `warmup_steps`
    steps, then constant `lr`. megatron-core's optimiser (`set_step`) has its scheduler, built
    from the same two values; ShardedAdamW gets the rate set here."""
    if hasattr(optimizer, "set_step"):
        optimizer.set_step(step)
        return
    scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    optimizer.lr = lr * scale


def build_optimizer(chunks: list[torch.nn.Module], opt, *, precision: str, device):
    """The optimiser of `precision` on `device` (see `choose_optimizer`)."""
    kind = choose_optimizer(device, precision)
    if kind == MEGATRON_CORE:
        return MegatronCoreAdamW(chunks, opt, precision=precision)

    return ShardedAdamW(
        chunks,
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        clip_grad=opt.grad_clip,
    )
