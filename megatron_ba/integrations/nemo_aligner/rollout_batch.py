"""GRPO rollout data for the actor, from NeMo-Aligner's rollout batches (pure torch, no NeMo).

What the trainer (grpo_trainer.py) computes between generation and the update, kept apart so
that it is tested without a model:

* `global_group_ids`: explicit group ids, one per prompt, global over data-parallel ranks (rank r's
  j-th prompt of the step is group r * prompts_per_rank + j). NeMo-Aligner's REINFORCE finds groups
  as identical prompt rows (`calculate_rloo_baseline`), which merges duplicate prompts.
* `grpo_training_data`: group-normalised advantages (megatron_ba.advantages.group_advantages) of
  in-process verifiable rewards, optional zero-variance filtering, and the batch keys the actor
  reads. Filtering keeps shapes fixed (every DP rank runs the same number of micro-batches): the
  responses of a zero-variance group get an all-zero mask, hence length 0, and the plan leaves
  zero-length sequences out of every statistic (they weigh nothing and count for nothing).
* `response_texts`: decoded responses, for the math reward.
"""

from __future__ import annotations

import torch

from megatron_ba.advantages import group_advantages


def global_group_ids(num_local_prompts: int, prompts_per_rank: int, dp_rank: int) -> torch.Tensor:
    """[num_local_prompts] global group ids of this rank's prompts in this step."""
    if num_local_prompts > prompts_per_rank:
        raise ValueError(
            f"num_local_prompts: {num_local_prompts} prompts on DP rank {dp_rank}, more than "
            f"prompts_per_rank={prompts_per_rank} (model.reinforce.num_rollout_samples / DP)"
        )
    return dp_rank * prompts_per_rank + torch.arange(num_local_prompts)


def response_mask(
    prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """[B, seq_len - 1] float mask of the log-prob positions of response tokens.

    Log-prob position p scores token p + 1, so response tokens [prompt_len, response_len) are
    positions [prompt_len - 1, response_len - 1): NeMo-Aligner's `create_mask` layout.
    """
    pos = torch.arange(seq_len - 1)[None, :]
    lo = (prompt_lengths.long() - 1)[:, None]
    hi = (response_lengths.long() - 1)[:, None]
    return ((pos >= lo) & (pos < hi)).float()


def response_texts(
    tokens: torch.Tensor, prompt_lengths, response_lengths, ids_to_text
) -> list[str]:
    """The generated part of each row, decoded with the tokenizer's `ids_to_text`."""
    return [
        ids_to_text(tokens[i, int(prompt_lengths[i]) : int(response_lengths[i])].tolist())
        for i in range(tokens.shape[0])
    ]


def grpo_training_data(
    rollout: dict,
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    normalize_std: bool = True,
    std: str = "population",
    drop_zero_variance: bool = False,
) -> tuple[dict, dict[str, float]]:
    """(the actor's batch, this rank's metrics) from one rank's rollouts.

    `rollout` holds NeMo-Aligner's keys: response_tokens [B, S], prompt_lengths [B],
    response_lengths [B], logprobs [B, S-1] (and init_logprobs [B, S-1] for the KL).
    Groups must be whole on this rank (the trainer generates all G responses of a prompt where
    the prompt is), which makes the advantages local; the plan's statistics are global.
    """
    tokens = rollout["response_tokens"]
    b, s = tokens.shape
    for key in ("prompt_lengths", "response_lengths"):
        if tuple(rollout[key].shape) != (b,):
            raise ValueError(
                f"rollout[{key!r}]: must be [B] = ({b},), got {tuple(rollout[key].shape)}"
            )
    if tuple(rewards.shape) != (b,) or tuple(group_ids.shape) != (b,):
        raise ValueError(
            f"rewards, group_ids: must be [B] = ({b},), got {tuple(rewards.shape)}, "
            f"{tuple(group_ids.shape)}"
        )
    report = group_advantages(
        rewards.double(),
        group_ids,
        normalize_std=normalize_std,
        std=std,
        drop_zero_variance=drop_zero_variance,
    )
    mask = response_mask(rollout["prompt_lengths"], rollout["response_lengths"], s)
    mask = mask * report.keep[:, None].to(mask.dtype)  # dropped groups: length 0 in the plan
    data = {
        "response_tokens": tokens,
        "mask": mask,
        "logprobs": rollout["logprobs"],
        "advantages": report.advantages.float(),
        "group_ids": group_ids.long(),
    }
    if "init_logprobs" in rollout:
        data["init_logprobs"] = rollout["init_logprobs"]
    metrics = {
        "reward_sum": float(rewards.sum()),
        "num_samples": float(b),
        "zero_variance_groups": float(report.num_zero_variance_groups),
        "num_groups": float(report.num_groups),
        "dropped_sequences": float(report.num_dropped_sequences),
    }
    return data, metrics
