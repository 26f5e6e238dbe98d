"""`BalancedGRPOTrainer`: TRL's GRPOTrainer with the loss aggregated by a megatron-ba plan.

TRL generates one *generation batch* per `steps_per_generation` micro-steps (on every process),
scores it, computes group advantages, then shuffles and splits it into micro-batches for gradient
accumulation. Its own loss types normalise each micro-batch (`grpo`: a per-micro-batch sequence
mean; `bnpo`: a per-micro-batch token mean) or by the generation batch's token count (`dapo`).

Here the plan is built once per generation batch, right after scoring, from whole-completion
lengths, TRL's advantages and the prompt-group ids, with the statistics table summed over all
processes (one all-reduce through `megatron_ba.parallel.collectives.StatisticsReducer`). The
per-sequence weights ride along in the batch dict (`ba_weights`, `ba_reg_weights`), so every
micro-batch applies its rows' *global* weights and the micro-batches and processes add up to the
single-process, single-step objective exactly (tests/test_integration_trl.py).

Scaling (what each factor cancels):
- x num_processes: DDP averages gradients over processes; the plan's shares must be summed.
- x steps_per_generation / gradient_accumulation_steps: one generation batch spans that many
  optimizer steps (1 by default); each step then carries a full-scale objective, as TRL's `dapo`
  does. Exact equality with one step holds for the default steps_per_generation == GA steps.
- no / gradient_accumulation_steps: the shares already add up over the accumulation window, and
  TRL marks its loss as scaled (`loss_is_scaled_for_ga = True`), so the Trainer divides by nothing.

vLLM importance-sampling correction (`args.vllm_importance_sampling_correction`, TRL's default with
vLLM): TRL computes the ratios itself, once per generation batch (`importance_sampling_ratio`:
[B, T] for the token modes, [B, 1] for the sequence modes, after its truncation or masking), and
multiplies its per-token loss by them. Here the same tensor is the core's `is_weights` (a
sequence mode's ratio repeated on the row's tokens): c_{i,t} multiplies w_i phi_{i,t}, the KL term
stays unweighted, as in TRL. A token that TRL's mask mode zeroes (c = 0) keeps its place in the
plan's denominators (lengths come from the completion mask, not from c), as it keeps it in every
TRL loss type's (`num_items_in_batch`, a row's mask sum): it adds 0 to the numerator only.

MoE router loss: where TRL enables it (`aux_loss_enabled`: a model with `output_router_logits`
and a nonzero `router_aux_loss_coef`), the loss adds `router_aux_loss_coef * aux_loss /
gradient_accumulation_steps` (train; undivided in eval) as TRL does, `aux_loss` being the model's
load-balancing loss of the micro-batch.
"""

from __future__ import annotations

import dataclasses

import torch
from trl import GRPOTrainer

from megatron_ba.diagnostics import batch_diagnostics
from megatron_ba.integrations._common import sequence_lengths
from megatron_ba.integrations.trl.trl_settings import aggregation_settings, clip_config
from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.parallel import collectives
from megatron_ba.parallel.collectives import StatisticsReducer

# TRL options whose per-token effects a per-sequence plan of the clipped PPO term does not model:
# refused with a clear error instead of being silently ignored.
_UNSUPPORTED = {
    "importance_sampling_level": ("token", "sequence-level ratios (GSPO) are not a token plan"),
    "top_entropy_quantile": (1.0, "an entropy mask changes which tokens count"),
    "off_policy_mask_threshold": (None, "an off-policy mask changes which tokens count"),
    "delta": (None, "two-sided clipping is not the core's PPO term"),
    "entropy_coef": (0.0, "pass entropy_coef= to BalancedGRPOTrainer instead"),
    "use_adaptive_entropy": (False, "adaptive entropy control is TRL's own"),
}
# GRPOConfig's default loss_type: the only value that does not ask for another loss.
_TRL_DEFAULT_LOSS = "dapo"


class BalancedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose policy-gradient term is aggregated by a core rule.

    Args (beyond GRPOTrainer's):
        aggregation: one of megatron_ba.aggregation.RULES ("balanced" by default).
        scope: "group" (mean over prompt groups) or "batch" (pooled).
        neutral_eps: responses with |A| <= neutral_eps count for no sign (balanced rules).
        entropy_coef: weight of an entropy bonus aggregated by the regulariser plan.
        reg_rule, reg_scope: the plan of the KL (args.beta) and entropy terms (token mean
            over the generation batch by default, as in megatron_ba.loss).

    TRL's `loss_type` is replaced by `aggregation` and must stay at its default ("dapo"): any
    other value, and every other setting whose effect this loss would drop (`_UNSUPPORTED`, the
    KL bias correction), raises ValueError naming it. Clipping comes from args.epsilon /
    args.epsilon_high, the KL coefficient from args.beta, the dr_grpo budget from
    args.max_completion_length. TRL's vLLM importance-sampling ratios and a MoE router loss are
    applied as TRL applies them (module docstring).
    """

    def __init__(
        self,
        *args,
        aggregation: str = "balanced",
        scope: str = "group",
        neutral_eps: float = 0.0,
        entropy_coef: float = 0.0,
        reg_rule: str = "token",
        reg_scope: str = "batch",
        **kwargs,
    ):
        settings = aggregation_settings(  # checked before TRL builds anything
            aggregation, scope, reg_rule=reg_rule, reg_scope=reg_scope, neutral_eps=neutral_eps
        )
        self.ba_rule = aggregation
        super().__init__(*args, **kwargs)
        self._refuse_ignored_settings()
        # The plan's settings, with dr_grpo's budget: TRL's max_completion_length.
        self.ba_aggregation = dataclasses.replace(settings, max_length=self.max_completion_length)
        self.ba_loss_config = clip_config(
            self.epsilon_low, self.epsilon_high, kl_coef=self.beta, entropy_coef=entropy_coef
        )
        group = collectives.world_group() if self.accelerator.num_processes > 1 else None
        self.ba_reducer = StatisticsReducer(group=group)

    def _refuse_ignored_settings(self) -> None:
        """Raise ValueError naming each TRL setting whose effect `_compute_loss` would drop."""
        for name, (allowed, why) in _UNSUPPORTED.items():
            value = getattr(self.args, name, allowed)
            if value != allowed:
                raise ValueError(
                    f"args.{name}: BalancedGRPOTrainer supports only {allowed!r} ({why}), got "
                    f"{value!r}"
                )
        if self.args.loss_type != _TRL_DEFAULT_LOSS:
            # TRL's loss types are aggregation rules (or other per-token objectives); this
            # trainer's loss replaces them all, so any other value would be silently ignored.
            raise ValueError(
                f"args.loss_type: is {self.args.loss_type!r}, which BalancedGRPOTrainer does not "
                f"use (its loss is the plan of aggregation={self.ba_rule!r}). Leave loss_type at "
                f"its default {_TRL_DEFAULT_LOSS!r} and choose the aggregation with aggregation= "
                f"(TRL's 'grpo' / 'dapo' / 'dr_grpo' are aggregation='sequence' / 'token' / "
                f"'dr_grpo', scope='batch'), or use trl.GRPOTrainer for loss_type="
                f"{self.args.loss_type!r}"
            )
        if self.beta != 0.0 and getattr(self.args, "use_bias_correction_kl", False):
            raise ValueError(
                "args.use_bias_correction_kl: BalancedGRPOTrainer needs False when args.beta != 0 "
                "(the core's KL term is the plain k3 estimator, without TRL's importance-ratio "
                "correction); set use_bias_correction_kl=False"
            )

    # -- planning: once per generation batch ---------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        return self.attach_plan(output, "train" if self.model.training else "eval")

    def attach_plan(self, output: dict, mode: str = "train") -> dict:
        """Add `ba_weights` / `ba_reg_weights` ([n_local]) for a scored generation batch."""
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        lengths = sequence_lengths(mask, name="completion_mask")
        advantages = output["advantages"].to(torch.float64)
        # TRL orders the gathered generation batch in blocks of `group_size` completions of one
        # prompt and gives process p rows [p * n, (p + 1) * n): global row // group_size is the
        # group (the same blocks its advantages are computed over).
        n_local = lengths.numel()
        num_processes = self.accelerator.num_processes
        first = self.accelerator.process_index * n_local
        group_ids = torch.arange(first, first + n_local, device=lengths.device) // group_size
        num_groups = -(-n_local * num_processes // group_size)
        plan = LossPlan.build(
            self.ba_aggregation,
            lengths,
            advantages,
            group_ids,
            reduce=self.ba_reducer,
            num_groups=num_groups,
        )
        output["ba_weights"] = plan.pg_weights
        output["ba_reg_weights"] = plan.reg_weights
        self._log_plan_diagnostics(mode, lengths, advantages, group_ids, num_groups)
        return output

    def _log_plan_diagnostics(self, mode, lengths, advantages, group_ids, num_groups) -> None:
        """The paper's batch statistics (megatron_ba.diagnostics) into TRL's metrics as `ba/...`."""
        if self.accelerator.num_processes == 1:
            diag = batch_diagnostics(
                lengths,
                advantages,
                group_ids,
                scope=self.ba_aggregation.scope,
                neutral_eps=self.ba_aggregation.neutral_eps,
            )
        else:
            diag = batch_diagnostics(
                lengths,
                advantages,
                group_ids,
                scope=self.ba_aggregation.scope,
                neutral_eps=self.ba_aggregation.neutral_eps,
                reduce=self.ba_reducer,
                num_groups=num_groups,
            )
            diag = {k: v for k, v in diag.items() if not k.endswith("_part")}  # rank-local parts
        for key, value in diag.items():
            self._metrics[mode][f"ba/{key}"].append(float(value))

    # -- applying: every micro-batch ------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask
        if "tool_mask" in inputs:
            mask = completion_mask * inputs["tool_mask"]
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=self.ba_loss_config.entropy_coef > 0,
            compute_aux_loss=self.aux_loss_enabled,
        )
        # As in TRL: without a stored old policy (num_iterations == 1, one generation batch per
        # optimizer step) the old log-probs are the current ones, detached (ratio 1).
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        plan = LossPlan(inputs["ba_weights"], inputs["ba_reg_weights"], inputs["advantages"])
        loss, metrics = grpo_loss(
            logps,
            old,
            mask.bool(),
            plan,
            self.ba_loss_config,
            ref_logprobs=inputs.get("ref_per_token_logps"),
            entropy=entropies,
            is_weights=self._vllm_is_weights(inputs, logps),
        )
        mode = "train" if self.model.training else "eval"
        scale = float(self.accelerator.num_processes)  # cancels DDP's mean over processes
        if mode == "train":
            # one generation batch spans steps_per_generation / GA optimizer steps (1 by default)
            scale *= self.args.steps_per_generation / self.current_gradient_accumulation_steps
        self._log_loss_metrics(mode, metrics, mask)
        loss = loss * scale
        if self.aux_loss_enabled:  # as TRL: its micro-batch's router loss, divided by GA steps
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / normalizer
            aux = self.accelerator.gather_for_metrics(aux_loss.detach())
            self._metrics[mode]["aux_loss"].append(aux.mean().item())
        return loss

    def _vllm_is_weights(self, inputs, logps: torch.Tensor) -> torch.Tensor | None:
        """TRL's vLLM importance-sampling ratios as per-token `is_weights`, where TRL's own loss
        applies them (None otherwise): [B, T] as they are, [B, 1] repeated on the row's tokens."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return None
        ratio = inputs.get("importance_sampling_ratio")
        if ratio is None:
            raise ValueError(
                "inputs['importance_sampling_ratio']: missing with vllm_importance_sampling_"
                "correction on; the batch must come from TRL's _generate_and_score_completions"
            )
        rows, tokens = logps.shape
        if ratio.dim() != 2 or ratio.shape[0] != rows or ratio.shape[1] not in (1, tokens):
            raise ValueError(
                f"inputs['importance_sampling_ratio']: must be [B, T] (token modes) or [B, 1] "
                f"(sequence modes) for log-probs {tuple(logps.shape)}, got {tuple(ratio.shape)}"
            )
        return ratio.expand_as(logps)

    def _log_loss_metrics(self, mode, metrics, mask) -> None:
        reduce = self.accelerator.reduce
        sums = torch.stack(
            [
                metrics["pg_loss"].detach().to(torch.float64),
                metrics["weight_pos_sum"].to(torch.float64),
                metrics["weight_neg_sum"].to(torch.float64),
            ]
        )
        sums = reduce(sums, reduction="sum")
        m = self._metrics[mode]
        # pg_loss of a micro-batch is its additive share; summed over processes it is the share
        # of this micro-step (the window's -J is the sum over the accumulation steps).
        m["ba/pg_loss_share"].append(float(sums[0]))
        total = float(sums[1] + sums[2])
        m["ba/weight_pos_share"].append(float(sums[1]) / total if total > 0 else float("nan"))
        n_tok = float(reduce(mask.sum().to(torch.float64), reduction="sum"))
        for key in ("clip_low_frac", "clip_high_frac", "ratio_mean"):
            local = metrics[key].to(torch.float64) * mask.sum()
            m[f"ba/{key}"].append(float(reduce(local, reduction="sum")) / max(n_tok, 1.0))
        if "kl" in metrics:
            m["kl_share"].append(float(reduce(metrics["kl"].to(torch.float64), reduction="sum")))
