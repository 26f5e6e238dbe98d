"""The GRPO actor: NeMo-Aligner's REINFORCE actor with megatron-ba's loss and weight plan.

`MegatronGPTGRPOActorModel` subclasses NeMo-Aligner 0.7.0's `MegatronGPTReinforceActorModel` and
replaces only the loss path (`get_loss_and_metrics`, `get_actor_forward_output_and_loss_func`);
model building, generation, inference log-probs, the optimizer and checkpoints are NeMo's.
The math is megatron-ba's core, called, not copied:

* the plan: `LossPlan.build` on this optimizer step's batch (whole-sequence lengths, advantages,
  explicit group ids), its statistics summed over the data-parallel group by one
  `StatisticsReducer` call per step; the per-sequence weights travel with the batch, so every
  micro-batch (of any size) carries its exact share of the global loss;
* the loss: `megatron_ba.loss.grpo_loss` (clipped ratio, optional dual clip, optional k3 KL to
  the reference policy) on `vocab_parallel_logprobs` of the TP-sharded logits;
* the scaling: `megatron_ba.megatron.loss_scale.loss_scale` cancels megatron-core 0.10's 1 / M in
  the schedule and NeMo's 1 / (DP x CP) in `allreduce_gradients` (see `_loss_scale`).

Defects of the parent's loss this fixes (nemo-aligner 0.7.0, megatron_gpt_reinforce_actor.py):
a per-micro-batch masked mean (so the result depends on the micro-batch split, hence
`micro_batch_size: 1` in its configs), metrics broadcast from the world's last rank, and batch
keys filtered for PP>1 by a hard-coded list that does not name ours (`PIPELINE_KEYS` here).

Batch keys (one row per response; S = padded sequence length):
  response_tokens [B, S] (prompt + response), mask [B, S-1] (1 on log-prob positions of response
  tokens, as NeMo-Aligner's `create_mask`), logprobs [B, S-1] (the rollout policy's), advantages
  [B], group_ids [B] (global, in [0, model.reinforce.num_rollout_samples)), optional
  init_logprobs [B, S-1] (the reference policy's; read when model.grpo.kl_coef > 0).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mcore_ps
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from nemo.collections.nlp.modules.common.megatron.utils import get_iterator_k_split
from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import (
    MegatronGPTReinforceActorModel,
)
from nemo_aligner.utils import parallel_state
from nemo_aligner.utils.train_utils import set_sync_funcs

from megatron_ba.diagnostics import batch_diagnostics
from megatron_ba.integrations.nemo_aligner.config import grpo_settings
from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.megatron.loss_scale import loss_scale
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.parallel import collectives

# Keys each pipeline stage needs (the rest become None there, as in the parent): the first stage
# embeds tokens, the last computes the loss. The parent's list lacks our keys.
FIRST_STAGE_KEYS = ("response_tokens", "position_ids", "attention_mask")
LAST_STAGE_KEYS = (
    "response_tokens",
    "attention_mask",
    "mask",
    "logprobs",
    "init_logprobs",
    "advantages",
    "pg_weights",
    "reg_weights",
)
REQUIRED_KEYS = ("response_tokens", "mask", "logprobs", "advantages", "group_ids")


class _ReplayReduce:
    """Sums the statistics table over DP once; later calls with the same table replay the sum.

    The plan and the diagnostics are both computed from the same per-group table; this makes the
    diagnostics cost no second collective.
    """

    def __init__(self, reducer: collectives.StatisticsReducer):
        self.reducer = reducer
        self._key: torch.Tensor | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, table: torch.Tensor) -> torch.Tensor:
        if self._key is not None and torch.equal(self._key, table):
            return self._value.clone()
        self._key, self._value = table.clone(), self.reducer(table)
        return self._value.clone()


def check_batch(batch: dict) -> None:
    """ValueError naming the key when the GRPO batch is incomplete or mis-shaped."""
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(
            f"batch: the GRPO actor needs the keys {missing} (see actor.py's docstring)"
        )
    b, s = batch["response_tokens"].shape
    for k in ("mask", "logprobs", "init_logprobs"):
        if k in batch and tuple(batch[k].shape) != (b, s - 1):
            raise ValueError(
                f"batch[{k!r}]: must be [B, S-1] = {(b, s - 1)}, got {tuple(batch[k].shape)}"
            )
    for k in ("advantages", "group_ids"):
        if tuple(batch[k].shape) != (b,):
            raise ValueError(f"batch[{k!r}]: must be [B] = ({b},), got {tuple(batch[k].shape)}")


class MegatronGPTGRPOActorModel(MegatronGPTReinforceActorModel):
    """NeMo-Aligner's REINFORCE actor whose loss is megatron-ba's GRPO loss with a BA plan."""

    def __init__(self, cfg, trainer):
        super().__init__(cfg, trainer)
        self.grpo = grpo_settings(cfg)
        self.last_reducer: collectives.StatisticsReducer | None = None
        self._current_factor: int | None = None  # set per step by get_loss_and_metrics

    # --- the plan ---------------------------------------------------------------------------
    def build_plan(
        self, batch: dict
    ) -> tuple[LossPlan, dict[str, float], collectives.StatisticsReducer]:
        """The plan of this optimizer step (one DP all-reduce) and the core's diagnostics."""
        s = self.grpo
        mask = batch["mask"].bool()
        lengths = mask.sum(dim=1).to(torch.float64)  # whole sequences: NeMo-Aligner has no CP
        adv = batch["advantages"].to(torch.float64)
        gids = batch["group_ids"].long()
        reducer = collectives.StatisticsReducer(mcore_ps.get_data_parallel_group())
        replay = _ReplayReduce(reducer)
        plan = LossPlan.build(
            s.aggregation_settings(), lengths, adv, gids, reduce=replay, num_groups=s.num_groups
        )
        diag = batch_diagnostics(
            lengths,
            adv,
            gids,
            scope=s.scope,
            neutral_eps=s.neutral_eps,
            reduce=replay,
            num_groups=s.num_groups,
        )
        return plan, diag, reducer

    def _loss_scale(self, num_microbatches: int) -> int:
        """The factor that cancels what happens to the loss on its way to the gradient.

        megatron-core 0.10 forward_step divides the 3-tuple loss by num_tokens (we report 1) and
        by num_microbatches; then NeMo's `allreduce_gradients` (grad_reductions, the plain-DDP
        path) divides the summed gradients by the DP x CP size (with distributed Adam or
        megatron-core's DDP the same 1 / (DP x CP) comes from their averaging). `loss_scale`
        multiplies by exactly M x DP x CP; per-token loss mode is read from the model config.
        """
        cp = mcore_ps.get_context_parallel_world_size()
        if cp != 1:
            raise ValueError(
                f"context_parallel_size: NeMo-Aligner's actor does not shard sequences (CP={cp}); "
                "the GRPO actor needs CP = 1"
            )
        config = self.model.config if hasattr(self.model, "config") else self.model[0].config
        return loss_scale(
            num_microbatches,
            mcore_ps.get_data_parallel_world_size(),
            cp,
            per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
        )

    # --- the loss ---------------------------------------------------------------------------
    def get_actor_forward_output_and_loss_func(self):
        s = self.grpo
        factor = self._current_factor
        if factor is None:
            raise RuntimeError("get_actor_forward_output_and_loss_func: call get_loss_and_metrics")
        one = torch.ones((), dtype=torch.int)

        def fwd_output_and_loss_func(data_iterator, model):
            batch = next(data_iterator)
            needed: set[str] = set()
            if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                needed.update(batch)
            else:
                needed.add("attention_mask")
                if mcore_ps.is_pipeline_first_stage():
                    needed.update(FIRST_STAGE_KEYS)
                if mcore_ps.is_pipeline_last_stage():
                    needed.update(LAST_STAGE_KEYS)
            batch = {
                k: (v.cuda(non_blocking=True) if k in needed else None) for k, v in batch.items()
            }
            parallel_logits = model(
                batch["response_tokens"],
                batch["position_ids"],
                batch["attention_mask"],
                labels=None,
            )

            def loss_func(parallel_logits):
                tp = mcore_ps.get_tensor_model_parallel_world_size()
                tokens = batch["response_tokens"]
                logp = vocab_parallel_logprobs(
                    parallel_logits[:, :-1],  # position p predicts token p + 1
                    tokens[:, 1:],
                    tp_group=mcore_ps.get_tensor_model_parallel_group() if tp > 1 else None,
                    temperature=s.temperature,
                    chunk_size=s.logprob_chunk_size,
                )
                plan = LossPlan(batch["pg_weights"], batch["reg_weights"], batch["advantages"])
                part, metrics = grpo_loss(
                    logp,
                    batch["logprobs"].to(logp.dtype),
                    batch["mask"].bool(),
                    plan,
                    s.loss,
                    ref_logprobs=None
                    if batch.get("init_logprobs") is None
                    else batch["init_logprobs"].to(logp.dtype),
                )
                reported = {"loss_sum": part.detach()}
                for k, v in metrics.items():
                    if k.endswith("_sum") or k in ("pg_loss", "kl"):
                        reported[k if k.endswith("_sum") else k + "_sum"] = v.detach()
                # `part` is this micro-batch's exact share of the global loss; `factor` cancels
                # megatron-core's 1/M and NeMo's 1/(DP x CP) (see _loss_scale).
                return part * factor, one, reported

            return parallel_logits, loss_func

        return fwd_output_and_loss_func

    def get_loss_and_metrics(self, batch, forward_only):
        check_batch(batch)
        batch = dict(batch)
        seq_len = batch["response_tokens"].size(1)
        attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(
            tokens=batch["response_tokens"]
        )
        batch["attention_mask"] = attention_mask
        batch["position_ids"] = position_ids
        if self.grpo.loss.kl_coef == 0:
            batch.pop("init_logprobs", None)
        elif "init_logprobs" not in batch:
            raise ValueError("batch['init_logprobs']: required when model.grpo.kl_coef > 0")
        plan, diag, reducer = None, {}, None
        if mcore_ps.is_pipeline_last_stage():  # the loss (hence the plan) lives there only
            plan, diag, reducer = self.build_plan(batch)
            batch["pg_weights"], batch["reg_weights"] = plan.pg_weights, plan.reg_weights
        else:
            n = batch["response_tokens"].size(0)
            batch["pg_weights"] = batch["reg_weights"] = torch.zeros(n, dtype=torch.float64)
        batch.pop("group_ids")
        num_mb = get_num_microbatches()
        self._current_factor = self._loss_scale(num_mb)
        set_sync_funcs(self, forward_only)
        store = get_forward_backward_func()(
            forward_step_func=self.get_actor_forward_output_and_loss_func(),
            data_iterator=self._make_data_iterator_list(get_iterator_k_split(batch, num_mb)),
            model=self.model,
            num_microbatches=num_mb,
            forward_only=forward_only,
            seq_length=seq_len,
            micro_batch_size=self.cfg.micro_batch_size,
        )
        self.last_reducer = reducer
        metrics = self._global_metrics(store)
        metrics.update({f"ba/{k}": v for k, v in self._broadcast_diag(diag).items()})
        return metrics["loss"], metrics

    def _global_metrics(self, store: list[dict]) -> dict[str, float]:
        """Micro-batch sums added over DP on the last stage, then sent to every PP stage."""
        out = collectives.sum_microbatch_metrics(
            store,
            last=mcore_ps.is_pipeline_last_stage(),
            dp_group=mcore_ps.get_data_parallel_group(),
            pp_group=mcore_ps.get_pipeline_model_parallel_group(),
        )
        out["loss"] = out.pop("loss_sum", 0.0)
        w_pos, w_neg = out.get("weight_pos_sum", 0.0), out.get("weight_neg_sum", 0.0)
        if w_pos + w_neg > 0:
            out["weight_pos_share"] = w_pos / (w_pos + w_neg)
        return out

    def _broadcast_diag(self, diag: dict[str, float]) -> dict[str, float]:
        """The last stage's diagnostics on every PP stage (NeMo logs from any rank)."""
        return collectives.broadcast_object_from_last_stage(
            diag, group=mcore_ps.get_pipeline_model_parallel_group()
        )
