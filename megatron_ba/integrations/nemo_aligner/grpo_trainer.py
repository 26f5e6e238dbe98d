"""The GRPO trainer: NeMo-Aligner's ReinforceTrainer with GRPO rollouts (explicit groups).

`GRPOTrainer` subclasses nemo-aligner 0.7.0's `ReinforceTrainer` and overrides two methods; its
loop (`fit`, `generate_rollouts`, `run_training`, validation, checkpoints, NeMo's logger) is
the parent's:

* `_run_inference`: generates G = trainer.reinforce.num_rollouts_per_prompt responses per prompt
  with the actor's `infer` (NeMo's megatron generation; `trt_llm.enable: False` off clusters),
  gives each prompt an explicit global group id, scores the responses in-process against each
  prompt's ground truth (megatron_ba.rewards, no reward-model server) and computes the rollout
  policy's log-probs (and the reference's when model.grpo.kl_coef > 0). Each data-parallel rank
  keeps its own rollouts: the parent gathers every rank's rollouts and then `chunk`s with
  `torch.arange(B)`, so every DP rank trained on the whole global batch.
* `generate_reinforce_data`: group-normalised advantages keyed by the group ids (not by identical
  prompt rows), optional zero-variance filtering (rollouts.grpo_training_data).

The plan's statistics are all-reduced once per optimizer step inside the actor's loss; its
diagnostics come back in the actor's metrics, which the parent's `run_training` logs with
prefix `train_optim/` through NeMo's logger. What has run where: docs/status.md.

The prompt batches need a `ground_truth` list (one string per prompt) and `index` (the prompts'
rows in the data file) besides NeMo-Aligner's `text` and `length`: train_grpo.py's dataset and
collate function provide them.
"""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state as mcore_ps
from nemo_aligner.algorithms.reinforce import (
    ReinforceRolloutBatch,
    ReinforceTrainer,
    compute_num_rollout_microbatches,
)
from nemo_aligner.utils import parallel_state

from megatron_ba.integrations.nemo_aligner.config import check_reinforce_keys
from megatron_ba.integrations.nemo_aligner.rollout_batch import (
    global_group_ids,
    grpo_training_data,
    response_texts,
)
from megatron_ba.parallel import collectives
from megatron_ba.rewards import math_score_batch


def math_rewards(responses: list[str], ground_truths: list[str]) -> torch.Tensor:
    """Verifiable math rewards (1 / 0), in-process, never hanging (megatron_ba.rewards)."""

    return torch.tensor(math_score_batch(responses, ground_truths), dtype=torch.float64)


class GRPOTrainer(ReinforceTrainer):
    """ReinforceTrainer with GRPO rollouts; pass `rm=None` (rewards are computed here)."""

    def __init__(self, *args, reward_fn=math_rewards, **kwargs):
        super().__init__(*args, **kwargs)
        check_reinforce_keys(self.cfg)  # the REINFORCE keys model.grpo replaces
        self.reward_fn = reward_fn
        self.grpo = self.model.grpo  # the actor's model.grpo settings

    def _run_inference(self, dataloader_builder, consumed_samples, is_validation):
        dataloader = dataloader_builder(consumed_samples=consumed_samples)
        num_microbatches = compute_num_rollout_microbatches(dataloader)
        with self.timer("batch_iterator_init"):
            batches = self.batch_iterator_cls(
                iter(dataloader.batch_sampler),
                num_microbatches,
                dataloader.dataset,
                self.collate_fn,
            )
        dp, dp_rank = (
            parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_rank(),
        )
        prompts_per_rank = dataloader.batch_sampler.global_batch_size // dp
        group_size = 1 if is_validation else int(self.cfg.num_rollouts_per_prompt)
        rollouts, truths, seen = [], [], 0
        with self.timer("generate"):
            for batch in batches:
                for key in ("ground_truth", "index"):
                    if key not in batch:
                        raise ValueError(
                            f"batch[{key!r}]: the GRPO trainer's prompt batches need it "
                            "(train_grpo's collate provides it)"
                        )
                n = batch["text"].size(0)
                ids = global_group_ids(seen + n, prompts_per_rank, dp_rank)[seen:]
                seen += n
                first = int(batch["index"][0])
                for sample in range(group_size):
                    torch.manual_seed(self._sampling_seed(first, sample, is_validation))
                    rollout = self.model.infer(batch)
                    rollout["prompt_tokens"] = batch["text"]
                    rollout["group_ids"] = ids.to(rollout["response_lengths"].device)
                    rollouts.append(rollout)
                    truths.extend(batch["ground_truth"])
        local = ReinforceRolloutBatch.from_rollout_batches(
            rollouts,
            eos_id=self.model.tokenizer.eos_id,
            rollout_batch_seq_length=self.cfg.rollout_batch_seq_length,
        )
        texts = response_texts(
            local["response_tokens"].cpu(),
            local["prompt_lengths"],
            local["response_lengths"],
            self.model.tokenizer.ids_to_text,
        )
        local["rewards"] = self.reward_fn(texts, truths).to(local["response_lengths"].device)
        with self.timer("logprobs"):
            local["logprobs"] = self.model.get_inference_log_probs(local["response_tokens"])
        if not is_validation and self.grpo.kl_coef > 0:
            with self.timer("init_logprobs"):
                local["init_logprobs"] = self.model.get_init_policy_logprobs(
                    local["response_tokens"]
                )
        return local, self._global_rollout_metrics(local, seen)

    def _sampling_seed(self, first_prompt: int, sample: int, is_validation: bool) -> int:
        """The seed of one `infer` call: a function of the step, the batch's first prompt (its
        row in the data file) and the sample index only. NeMo's sampler draws from torch's
        default generator, which no checkpoint saves: seeded so, a resumed run samples what an
        uninterrupted one does, and with one prompt per rollout micro-batch the draws do not
        depend on the layout (TP ranks share the seed; a prompt's samples are the same on any
        DP rank)."""
        key = (int(self.model.cfg.seed), self.step, first_prompt, sample, int(is_validation))
        return zlib.crc32(repr(key).encode())

    def _global_rollout_metrics(self, local, num_prompts: int) -> dict:
        """The parent's rollout metrics over all DP ranks (each holds only its own rollouts)."""
        table = self.compute_rollout_metrics(local)["table"]  # the first local sample, for logging
        sums = torch.tensor(
            [
                float(num_prompts),
                float(local["response_lengths"].numel()),
                float(local["response_lengths"].float().sum()),
                float(local["prompt_lengths"].float().sum()),
                float(local["rewards"].float().sum()),
                float(local["is_end"].float().sum()),
            ],
            dtype=torch.float64,
        )
        p, n, resp, prompt, reward, ended = collectives.all_reduce_sum(
            sums, group=mcore_ps.get_data_parallel_group()
        ).tolist()
        return {
            "table": table,
            # consumed_samples counts prompts (the sampler's unit); the parent added responses.
            "rollout_size": int(p),
            "num_responses": n,
            "response_lengths": resp / n,
            "prompt_lengths": prompt / n,
            "generation_length": (resp - prompt) / n,
            "rewards": reward / n,
            "fraction_of_samples_properly_ended": ended / n,
        }

    def generate_reinforce_data(self, rollout_batch):
        data, metrics = grpo_training_data(
            {k: v.cpu() if torch.is_tensor(v) else v for k, v in rollout_batch.items()},
            rewards=rollout_batch["rewards"].cpu(),
            group_ids=rollout_batch["group_ids"].cpu().long(),
            normalize_std=self.grpo.normalize_std,
            std=self.grpo.std,
            drop_zero_variance=self.grpo.drop_zero_variance,
        )
        keys = sorted(metrics)
        total = collectives.all_reduce_sum(
            torch.tensor([metrics[k] for k in keys], dtype=torch.float64),
            group=mcore_ps.get_data_parallel_group(),
        )
        g = dict(zip(keys, total.tolist(), strict=True))
        out = {
            "reward_mean": g["reward_sum"] / max(g["num_samples"], 1.0),
            "zero_variance_group_fraction": g["zero_variance_groups"] / max(g["num_groups"], 1.0),
            "dropped_sequences": g["dropped_sequences"],
        }
        return data, out
