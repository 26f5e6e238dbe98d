"""verl scores with this project's math reward: the recipe's overrides point verl's own reward
manager (naive, through verl's load_reward_manager and its custom_reward_function loader) at
megatron_ba/integrations/verl/reward.py, and verl's run_single on decoded responses returns
this project's judgement.

Runs in .venv-verl (bash scripts/run_verl_tests.sh). The control: the same manager without the
overrides scores with verl's own DAPO function, which gives a wrong answer -1, not 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

from hydra import compose, initialize_config_module
from verl import DataProto
from verl.trainer.ppo.reward import load_reward_manager

from megatron_ba.integrations.verl_recipe import recipe_to_verl_overrides
from megatron_ba.recipe import load_recipe
from megatron_ba.testing.tiny_hf import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FILES = ["backend=verl", "data.path=/data/dapo-math-17k.parquet", "eval.data_dir=/data/bench"]
# (response, ground truth, this project's score): the final "Answer:" line decides; hedging and
# an answer in running prose do not pay.
CASES = [
    ("The sum is 40 + 2.\nAnswer: 42", "42", 1.0),
    ("So we get\nAnswer: \\frac{1}{2}", "0.5", 1.0),
    ("It is 41.\nAnswer: 41", "42", 0.0),
    ("Answer: 41\nor maybe Answer: 42 or 41", "42", 0.0),
    ("We may check our answer: 42", "42", 0.0),
]


def _compose(overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=overrides)


def _scores(config, tokenizer) -> list[float]:
    manager = load_reward_manager(config, tokenizer)
    out = []
    for response, truth, _ in CASES:
        ids = tokenizer(response)["input_ids"]
        item = DataProto.from_dict(
            tensors={
                "responses": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            },
            non_tensors={
                "data_source": np.array(["math_dapo"], dtype=object),
                "reward_model": np.array([{"ground_truth": truth}], dtype=object),
            },
        )
        result = manager.loop.run_until_complete(manager.run_single(item))
        out.append(float(result["reward_score"]))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_verl_scores_with_this_projects_math_reward(tokenizer):
    recipe = load_recipe(ROOT / "recipes/qwen3-1.7b-dapo17k.yaml", [*FILES, "reward.timeout_s=4"])
    config = _compose(recipe_to_verl_overrides(recipe))
    fn = config.reward.custom_reward_function
    assert Path(fn.path).name == "reward.py" and fn.reward_kwargs.timeout_s == 4
    assert _scores(config, tokenizer) == [score for _, _, score in CASES]


def test_control_verls_own_dapo_score_differs(tokenizer):
    """Without the overrides verl's own math_dapo function scores: a wrong answer is -1."""
    config = _compose(["actor_rollout_ref.rollout.name=vllm"])
    assert config.reward.custom_reward_function.path is None
    assert _scores(config, tokenizer)[2] == -1.0


def test_a_bad_timeout_is_refused_by_name():
    from megatron_ba.integrations.verl.reward import compute_score

    with pytest.raises(ValueError, match="timeout_s"):
        compute_score("math_dapo", "Answer: 1", "1", timeout_s=0)
