"""verl scores with this project's rewards: the recipe's overrides point verl's own reward
manager (naive, through verl's load_reward_manager and its custom_reward_function loader) at
megatron_ba/integrations/verl/reward.py, and verl's run_single on decoded responses returns
this project's judgement: the math reward for math rows, the sandboxed code reward for
LiveCodeBench rows (the recipes validate on livecodebench.parquet), chosen by data_source.

Runs in .venv-verl (bash scripts/run_verl_tests.sh). The controls: the same manager without the
overrides scores with verl's own DAPO function, which gives a wrong answer -1, not 0; the right
program of a LiveCodeBench row, judged as a math row, scores 0 (the dispatch is what scores it 1);
a data_source with no judge is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

from hydra import compose, initialize_config_module
from verl import DataProto
from verl.trainer.ppo.reward import load_reward_manager

from megatron_ba.integrations.engines.verl import recipe_to_verl_overrides
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


def _score(manager, tokenizer, response, truth, source="math_dapo", extra_info=None) -> float:
    """verl's run_single on one row: `response` as its tokens, its data_source and ground truth."""
    ids = tokenizer(response)["input_ids"]
    non_tensors = {
        "data_source": np.array([source], dtype=object),
        "reward_model": np.array([{"ground_truth": truth}], dtype=object),
    }
    if extra_info is not None:
        non_tensors["extra_info"] = np.array([extra_info], dtype=object)
    item = DataProto.from_dict(
        tensors={
            "responses": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        },
        non_tensors=non_tensors,
    )
    result = manager.loop.run_until_complete(manager.run_single(item))
    return float(result["reward_score"])


def _scores(config, tokenizer) -> list[float]:
    manager = load_reward_manager(config, tokenizer)
    return [_score(manager, tokenizer, response, truth) for response, truth, _ in CASES]


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


# A LiveCodeBench row in verl's layout: its tests as JSON text (LiveCodeBench's form) in the
# ground truth. The right program adds the two numbers; the wrong one multiplies them (right on
# no test here: 2 * 2 == 2 + 2 is left out).
SUM_TESTS = json.dumps([
    {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
    {"input": "10 -4\n", "output": "6\n", "testtype": "stdin"},
])  # fmt: skip
RIGHT = "Read both.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "Read both.\n```python\na, b = map(int, input().split())\nprint(a * b)\n```"
# A functional row: the function's name in extra_info, as the reward reads it
MAX_TESTS = json.dumps([
    {"input": "[1, 5, 2]", "output": "5", "testtype": "functional"},
    {"input": "[-3, -1]", "output": "-1", "testtype": "functional"},
])  # fmt: skip
RIGHT_CALL = "```python\nclass Solution:\n    def biggest(self, xs):\n        return max(xs)\n```"
WRONG_CALL = "```python\nclass Solution:\n    def biggest(self, xs):\n        return min(xs)\n```"


@pytest.fixture(scope="module")
def manager(tokenizer):
    """verl's reward manager as the recipe's overrides configure it."""
    recipe = load_recipe(ROOT / "recipes/qwen3-1.7b-dapo17k.yaml", FILES)
    assert "livecodebench" in recipe.eval.benchmarks  # the paper recipes validate on it
    overrides = recipe_to_verl_overrides(recipe)
    (val,) = [o for o in overrides if o.startswith("data.val_files=")]
    assert "/data/bench/livecodebench.parquet" in val
    return load_reward_manager(_compose(overrides), tokenizer)


def test_a_livecodebench_row_is_scored_by_running_the_program(manager, tokenizer):
    assert _score(manager, tokenizer, RIGHT, SUM_TESTS, "livecodebench") == 1.0
    assert _score(manager, tokenizer, WRONG, SUM_TESTS, "livecodebench") == 0.0
    call = {"func_name": "biggest"}
    assert _score(manager, tokenizer, RIGHT_CALL, MAX_TESTS, "livecodebench", call) == 1.0
    assert _score(manager, tokenizer, WRONG_CALL, MAX_TESTS, "livecodebench", call) == 0.0


def test_control_the_right_program_judged_as_math_scores_0(manager, tokenizer):
    """What the row got before its data_source chose the judge: the math reward finds no
    answer equal to the tests, so the right program scores 0."""
    assert _score(manager, tokenizer, RIGHT, SUM_TESTS, "math_dapo") == 0.0


def test_math_rows_are_still_scored_by_the_math_reward(manager, tokenizer):
    for source in ("math_dapo", "math500", "aime24"):
        assert _score(manager, tokenizer, "So\nAnswer: 42", "42", source) == 1.0
        assert _score(manager, tokenizer, "So\nAnswer: 41", "42", source) == 0.0


def test_a_data_source_without_a_judge_is_refused_by_name(manager, tokenizer):
    with pytest.raises(ValueError, match=r"^data_source 'openai/gsm8k': .*livecodebench"):
        _score(manager, tokenizer, "Answer: 42", "42", "openai/gsm8k")


def test_a_functional_row_without_its_function_name_is_refused(manager, tokenizer):
    with pytest.raises(ValueError, match=r"^extra_info\.func_name: "):
        _score(manager, tokenizer, RIGHT_CALL, MAX_TESTS, "livecodebench")


def test_the_judges_cover_the_recipe_benchmarks_by_their_kind():
    """Every benchmark a recipe may name has a judge of its kind (data/benchmarks.py)."""
    from megatron_ba.data.benchmarks import BENCHMARKS
    from megatron_ba.integrations.verl.reward import CODE_SOURCES, MATH_SOURCES

    for name, spec in BENCHMARKS.items():
        assert name in (CODE_SOURCES if spec.kind == "code" else MATH_SOURCES), name
