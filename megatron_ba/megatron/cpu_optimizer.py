"""The CPU optimiser: global-norm clipping and torch AdamW over this rank's shards.

    optimizer = ShardedAdamW(chunks, lr=1e-6, weight_decay=0.0, clip_grad=1.0)    # once
    result = forward_backward(chunks, batch, cfg)      # megatron_ba.megatron.grpo_step
    applied, grad_norm = optimizer.step()              # clip by the global norm, AdamW step

`forward_backward` leaves the finalised gradient in each parameter's `main_grad` (megatron-core
DDP: reduced over DP x CP with our loss scale cancelling DDP's averaging; layer-norm and embedding
gradients synchronised by megatron-core's `finalize_model_grads`). This step then does what
megatron-core's FP32Optimizer does, in plain torch so that it runs on CPU (megatron-core 0.16.1's
optimiser allocates `device='cuda'` tensors in FP32Optimizer.__init__ and in
optimizer/clip_grads.py, so it cannot):

1. `.grad = main_grad` for every parameter of this rank;
2. the global gradient norm: squares summed over this rank's parameters, counting a parameter
   that is replicated across tensor-parallel ranks (norm weights, row-parallel biases) on TP rank
   0 only (megatron-core's `param_is_not_tensor_parallel_duplicate`), then a SUM over the
   model-parallel group (TP x PP); experts' squares are summed over the
   expert-tensor-model-pipeline group (ETP x EP x PP) instead, as megatron-core's
   get_grad_norm_fp32 does for its expert-parallel parameters. DP and CP ranks hold the same
   reduced gradient;
3. clipping by `clip_grad / (norm + 1e-6)` when the norm exceeds `clip_grad` (megatron-core's
   clip_grad_by_total_norm_fp32 factor); a non-finite norm skips the step;
4. torch.optim.AdamW on the shards (element-wise, so sharding does not change it), with
   megatron-core's parameter groups: its own `_get_param_groups` decides each parameter's
   weight-decay and learning-rate multipliers (by default no decay on biases and on 1-D
   parameters such as norm weights), so the CPU and the GPU optimiser decay the same parameters.

The clip threshold applies to the norm of the global objective's gradient, the same under every
layout. Parameters must be fp32 (mixed precision keeps fp32 master copies: use megatron-core's
optimiser on GPUs for that).
"""

from __future__ import annotations

import math

import torch

from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import is_expert_name


class ShardedAdamW:
    """AdamW on this rank's parameter shards with megatron-style global-norm clipping."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
    ) -> None:
        if not (lr >= 0 and math.isfinite(lr)):  # 0: a frozen run (exports equal the input)
            raise ValueError(f"lr: must be a finite number >= 0, got {lr!r}")
        if not (clip_grad >= 0):
            raise ValueError(f"clip_grad: must be >= 0 (0 disables clipping), got {clip_grad!r}")
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        # Experts (megatron-core marks them allreduce=False under expert parallelism, and names
        # them `.experts.`): their norm is summed over the expert-parallel ranks.
        self._expert_ids = {
            id(p)
            for c in chunks
            for n, p in c.named_parameters()
            if p.requires_grad and is_expert_name(n)
        }
        bad = [p.dtype for p in self.params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"chunks: ShardedAdamW needs fp32 parameters, got {bad[0]}")
        self.clip_grad = float(clip_grad)
        self._lr, self._weight_decay = float(lr), float(weight_decay)
        groups = megatron_param_groups(chunks, lr=lr, weight_decay=weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
        self._apply_multipliers()

    def _apply_multipliers(self) -> None:
        """Each group's lr and weight decay: the base values times its multipliers (what
        megatron-core's OptimizerParamScheduler sets)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr * group["lr_mult"]
            group["weight_decay"] = self._weight_decay * group["wd_mult"]

    def grad_norm(self) -> float:
        """The L2 norm of the whole model's gradient (a collective over TP x PP, and over
        ETP x EP x PP for a mixture-of-experts model)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        dense = torch.zeros((), dtype=torch.float64)
        experts = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq = p.grad.detach().double().pow(2).sum().cpu()
                if id(p) in self._expert_ids:
                    experts += sq
                else:
                    dense += sq
        total = collectives.all_reduce_sum(dense, group=parallel_state.get_model_parallel_group())
        if self._expert_ids:
            # Each expert lives on one rank of the expert-tensor-model-pipeline group
            # (ETP x EP x PP); a TP x PP sum would miss the other EP ranks' experts.
            group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            total = total + collectives.all_reduce_sum(experts, group=group)
        return math.sqrt(float(total))

    def step(self) -> tuple[bool, float]:
        """Clip and step; returns (applied, norm of the gradient before clipping)."""
        for p in self.params:
            main = getattr(p, "main_grad", None)
            if main is not None:
                p.grad = main.to(p.dtype)
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm
        if self.clip_grad > 0 and norm > self.clip_grad:
            factor = self.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        self.optimizer.step()
        self.zero_grad()
        return True, norm

    def zero_grad(self) -> None:
        # main_grad buffers are zeroed by forward_backward (DDP.zero_grad_buffer); `.grad` is a
        # view of them or a copy, dropped here.
        for p in self.params:
            p.grad = None

    @property
    def lr(self) -> float:
        """The base learning rate (each group runs it times its lr_mult)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
        self._apply_multipliers()

    # -- sharded checkpoints (train/checkpoint.py) -------------------------------------------
    # The Adam moments are saved as megatron-core ShardedTensors keyed like the model's own
    # (`optimizer.exp_avg.<model key>`, same global shape, offsets and replica ids), so
    # dist_checkpointing reshards them under another TP / PP / DP exactly as it does the weights.
    # megatron-core's optimiser (megatron/optimizer_choice.py) offers the same two methods.

    def step_count(self) -> int:
        """AdamW's step count, the same for every parameter (0 before the first step)."""
        steps = {int(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1 or (steps and len(self.optimizer.state) != len(self.params)):
            raise ValueError(f"optimizer: parameters at different step counts {sorted(steps)}")
        return steps.pop() if steps else 0

    def sharded_state_dict(self, model_sharded_sd: dict, is_loading: bool = False) -> dict:
        """The moments as ShardedTensors shaped like `model_sharded_sd`'s (from the chunks'
        `sharded_state_dict()`), the step count and the hyper-parameters as common state.
        `is_loading` is megatron-core's optimiser argument (the same call builds the target of a
        load); here the target is the same structure either way."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        by_id = get_param_id_to_sharded_param_map(model_sharded_sd, self.params)
        missing = [i for i in range(len(self.params)) if i not in by_id]
        if missing:
            n = len(missing)
            raise ValueError(f"model_sharded_sd: lacks {n} of the optimizer's parameters")
        moments: dict = {"exp_avg": {}, "exp_avg_sq": {}}
        for i, p in enumerate(self.params):
            state = self.optimizer.state.get(p, {})
            for name in moments:
                # Before the first step (or as the target of a load) the moments are zeros.
                data = state[name] if name in state else torch.zeros_like(p)
                prefix = f"optimizer.{name}"
                moments[name][i] = make_sharded_optimizer_tensor(by_id[i], data, prefix)
        group = self.optimizer.param_groups[0]
        # The base values: the groups' own follow from their multipliers.
        hyper = {"lr": self._lr, "betas": group["betas"], "eps": group["eps"]}
        hyper["weight_decay"] = self._weight_decay
        return {**moments, "step": self.step_count(), "hyper": hyper, "clip_grad": self.clip_grad}

    def load_sharded(self, state: dict) -> None:
        """Restore what `sharded_state_dict` saved, as loaded by dist_checkpointing.load."""
        step = int(state["step"])
        self.optimizer.state.clear()
        if step > 0:  # at 0 torch's lazy initialisation is the same zeros and count
            for i, p in enumerate(self.params):
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),  # torch's own dtype
                    "exp_avg": state["exp_avg"][i].to(p.device).clone(),
                    "exp_avg_sq": state["exp_avg_sq"][i].to(p.device).clone(),
                }
        hyper = state["hyper"]
        for group in self.optimizer.param_groups:
            group.update(betas=tuple(hyper["betas"]), eps=hyper["eps"])
        self._lr, self._weight_decay = float(hyper["lr"]), float(hyper["weight_decay"])
        self._apply_multipliers()
        self.clip_grad = float(state["clip_grad"])


def megatron_param_groups(chunks: list[torch.nn.Module], *, lr: float, weight_decay: float):
    """torch param groups of `chunks` as megatron-core's optimiser forms them: its own
    `_get_param_groups` with the overrides `get_megatron_optimizer` applies by default
    (`get_standard_config_overrides`: wd_mult 0 for biases and 1-D parameters), each group
    {"params", "wd_mult", "lr_mult"}. The overrides are passed explicitly: 0.16.1's
    `_get_param_groups` supplies them itself when given None, 0.19's does not. A collective over
    the world (megatron-core aligns the groups across ranks): every rank calls it."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )

    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay)
    groups = []
    for g in _get_param_groups(chunks, config, get_standard_config_overrides(config)):
        if g["params"]:  # megatron-core keeps groups empty on this rank to align the ranks
            groups.append({"params": g["params"], "wd_mult": g["wd_mult"], "lr_mult": g["lr_mult"]})
    return groups
