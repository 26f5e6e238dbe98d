"""`BalancedAsyncGRPOTrainer`: TRL's AsyncGRPOTrainer with its loss replaced by the split-step plan
of docs/math.md section 10 (megatron_ba.step_plan).

An optimiser step of the async trainer is a window of `gradient_accumulation_steps` packed
micro-batches, whatever groups and policy versions they hold (async_plan.py: how each sample
carries its whole group's weight w_i^g and share 1/|g| from the rollout queue). The trainer
sums the window's shares into Gamma_t (`get_batch_samples`, where the window is known before any
forward) and each process's micro-batch applies

    loss = -(1/Gamma_t) sum_{i in its rows} w_i^g sum_k phi_{i,k}

with the core's `grpo_loss`, so the window's micro-batches and processes add up to -J_t.

Scaling (what each factor cancels):
- 1/Gamma_t: the step's group count, the shares of the groups it holds (a whole group counts
  1); a step of whole groups is today's synchronous plan.
- x num_processes: DDP averages gradients over processes; the plan's shares must be summed.
- no / gradient_accumulation_steps: w_i^g / Gamma_t already add up over the window, and TRL marks
  the loss as scaled (`loss_is_scaled_for_ga = True`).

Rollout correction: AsyncGRPOTrainer has no separate vLLM importance-sampling weight. Its
old log-probs are the sampling policy's own (vLLM's, of the version that generated the sample),
so rho = pi_theta / pi_sampler in phi, clipped to [1 - epsilon, 1 + epsilon_high], is the whole
correction; it is kept as is: each sample's ratio is to its own version's log-probs. A MoE
router loss is added as TRL adds it (`router_aux_loss_coef * aux / gradient_accumulation_steps`).

Refused with SettingError naming the argument: `tools` and `environment_factory` (a
conversation's turns may fork into several training rows, so a completion's length and its
group's row count would not be whole), `scope="batch"` and `aggregation="dr_grpo"` (they pool the
step's own sequences, a per-window statistics reduction this trainer does not do).
"""

from __future__ import annotations

import inspect
import time

import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer

from megatron_ba.errors import SettingError
from megatron_ba.integrations.trl.async_plan import (
    GroupPlanQueue,
    PlanCollator,
    window_group_count,
)
from megatron_ba.integrations.trl.trl_settings import aggregation_settings, clip_config
from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.step_plan import GROUP_RULES

# Constructor arguments whose rollouts are not one training row per completion.
_MULTI_ROW = ("tools", "environment_factory")


class BalancedAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose policy-gradient term is the split-step plan of a core rule.

    Args (beyond AsyncGRPOTrainer's):
        aggregation: a group-scope rule of megatron_ba.step_plan.GROUP_RULES ("balanced").
        scope: "group" (the only one: module docstring).
        neutral_eps: responses with |A| <= neutral_eps count for no sign (balanced rules).
    """

    def __init__(
        self,
        *args,
        aggregation: str = "balanced",
        scope: str = "group",
        neutral_eps: float = 0.0,
        **kwargs,
    ):
        settings = aggregation_settings(aggregation, scope, neutral_eps=neutral_eps)
        _refuse_unsupported(settings, args, kwargs)
        super().__init__(*args, **kwargs)
        self.ba_aggregation = settings
        self.ba_loss_config = clip_config(self.epsilon_low, self.epsilon_high)
        if self.accelerator.is_main_process:  # only the main process reads the rollout queue
            self.rollout_queue = GroupPlanQueue(
                self.rollout_queue,
                rule=settings.rule,
                group_size=self.args.num_generations,
                neutral_eps=settings.neutral_eps,
            )

    # -- planning: the samples carry their groups' plans; a window sums their shares -----------

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.accelerator.is_main_process:
            # accelerate's dispatcher iterates its base loader on the main process only and
            # sends each process its row; the plan is packed there, with TRL's tensors.
            base = getattr(loader, "base_dataloader", loader)
            base.collate_fn = PlanCollator(base.collate_fn)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        gamma = window_group_count(batches)
        for batch in batches:
            weights = batch["ba_weights"]
            batch["ba_weights"] = weights / gamma if gamma > 0 else torch.zeros_like(weights)
        if batches:
            self._metrics["train"]["ba/step_groups"].append(gamma)
        return batches, num_items

    # -- applying: every micro-batch -----------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("return_outputs: BalancedAsyncGRPOTrainer returns the loss only")
        selected = inputs["token_index"] >= 0
        logps, aux_loss = self._term_logprobs(model, inputs, selected)
        seg = inputs["segment_id"][selected]
        n = int(seg.max()) + 1 if seg.numel() else 0
        # Every term of a sample carries its sample's values: one scatter per sequence.
        zeros = torch.zeros(n, dtype=torch.float64, device=logps.device)
        weights = zeros.scatter(0, seg, inputs["ba_weights"][selected].to(zeros))
        advantages = zeros.scatter(0, seg, inputs["ba_advantages"][selected].to(zeros))
        plan = LossPlan(weights, zeros, advantages)
        old = inputs["old_log_probs"][selected].to(logps.dtype)  # the sampler's, per version
        loss, metrics = grpo_loss(logps, old, seg, plan, self.ba_loss_config)
        loss = loss * self.accelerator.num_processes  # cancels DDP's mean over processes
        if self.aux_loss_enabled:  # as TRL: its micro-batch's router loss, over the window
            loss = loss + self.router_aux_loss_coef * aux_loss / (
                self.current_gradient_accumulation_steps
            )
        self._log_loss(metrics)
        self._account_step(inputs)
        return loss

    def _term_logprobs(self, model, inputs, selected):
        """Log-probs of the packed loss terms (and the MoE router loss), from one forward over
        this process's row through TRL's fused LM head, as TRL's compute_loss runs it."""
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        start = time.time()
        outputs = model(**packed_forward_inputs(inputs), fused_lm_head=True, **router)
        self._last_forward_time_s = time.time() - start
        logps = outputs.log_probs.flatten()[inputs["token_index"][selected]]
        return logps, (outputs.aux_loss if self.aux_loss_enabled else None)

    def _log_loss(self, metrics) -> None:
        """The micro-step's share of -J_t and the clip fractions, summed over processes."""
        n = metrics["num_tokens_sum"].to(torch.float64)
        local = torch.stack(
            [
                metrics["pg_loss"].to(torch.float64),
                metrics["clip_low_frac"].to(torch.float64) * n,
                metrics["clip_high_frac"].to(torch.float64) * n,
                metrics["ratio_mean"].to(torch.float64) * n,
                n,
            ]
        )
        pg, low, high, ratio, count = self.accelerator.reduce(local, reduction="sum").tolist()
        m = self._metrics["train"]
        m["ba/pg_loss_share"].append(pg)
        m["clip_ratio/low_mean"].append((low, count))
        m["clip_ratio/high_mean"].append((high, count))
        m["ratio"].append((ratio, count))

    def _account_step(self, inputs) -> None:
        """TRL's per-step throughput accounting (its `_log_step_metrics` reads these)."""
        forwarded = float(inputs["global_n_forward_tokens"][0])
        mean_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += forwarded
        self._step_trained_tokens += float(inputs["global_n_tokens"][0])
        self._step_seq_len_weighted += mean_len * forwarded
        self._step_samples += forwarded / mean_len
        self._step_forward_s += self._last_forward_time_s


def packed_forward_inputs(inputs: dict) -> dict:
    """The model's inputs for this process's packed row, as TRL's compute_loss builds them: the
    padding added across processes stripped, tree attention over the packed trie."""
    keep = inputs["attention_mask"].bool()
    tree = {
        k: inputs[k][inputs[k] >= 0]
        for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
    }
    tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    rows = {k: inputs[k][keep].unsqueeze(0) for k in ("input_ids", "position_ids", "shift_labels")}
    return {**rows, **tree}


def _refuse_unsupported(settings, args: tuple, kwargs: dict) -> None:
    """SettingError naming each argument whose effect the split-step plan cannot honour."""
    if settings.scope != "group":
        raise SettingError(
            "scope",
            f"BalancedAsyncGRPOTrainer supports only 'group', got {settings.scope!r} (the batch "
            "scope pools a step's own sequences, which a window of micro-batches does not plan)",
        )
    if settings.rule not in GROUP_RULES:
        raise SettingError(
            "aggregation",
            f"BalancedAsyncGRPOTrainer supports {', '.join(GROUP_RULES)}, got {settings.rule!r} "
            "(dr_grpo pools the step's sequences)",
        )
    bound = inspect.signature(AsyncGRPOTrainer.__init__).bind_partial(None, *args, **kwargs)
    for name in _MULTI_ROW:
        if bound.arguments.get(name) is not None:
            raise SettingError(
                name,
                "BalancedAsyncGRPOTrainer needs one training row per completion (a group's "
                "statistics are its completions' whole lengths); multi-turn rollouts may fork "
                "a conversation into several rows. Leave it None",
            )
