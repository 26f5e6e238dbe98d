"""The clipped loss's coefficients are declared once (rules.GRPOLossConfig) and checked where a
user writes them: the recipe's `loss` section and NeMo-Aligner's `model.grpo` extend the type, so
a bad value is refused when the settings are read, under the key the user typed."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from megatron_ba.errors import SettingError
from megatron_ba.integrations.nemo_aligner.config import GRPOSettings, grpo_settings
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig
from megatron_ba.recipe import LossSection, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
COEFFICIENTS = [f.name for f in fields(GRPOLossConfig)]

BAD = [
    ("clip_low", 1.5, "must be < 1"),
    ("clip_high", -0.1, "must be a finite number >= 0"),
    ("kl_coef", float("nan"), "must be a finite number >= 0"),
    ("dual_clip", 0.5, "must be a finite number > 1 or None"),
    ("dual_clip", True, "must be a finite number > 1 or None"),
]


@pytest.mark.parametrize(("key", "value", "problem"), BAD)
def test_a_bad_coefficient_names_its_field(key, value, problem):
    with pytest.raises(SettingError, match=f"^{key}: {problem}") as err:
        GRPOLossConfig(**{key: value})
    assert err.value.key == key


# The recipe's type coercion refuses a boolean before the section sees it ("expected float").
@pytest.mark.parametrize(("key", "value", "problem"), [b for b in BAD if b[1] is not True])
def test_the_recipe_refuses_it_when_loaded_under_its_key(key, value, problem):
    with pytest.raises(RecipeError, match=f"^loss\\.{key}: {problem}"):
        load_recipe(ROOT / "recipes/tiny-cpu.yaml", [f"loss.{key}={value}"])


@pytest.mark.parametrize(("key", "value", "problem"), BAD)
def test_nemo_aligner_refuses_it_under_model_grpo(key, value, problem):
    cfg = {"grpo": {key: value}, "reinforce": {"num_rollout_samples": 4}}
    with pytest.raises(ValueError, match=f"^model\\.grpo\\.{key}: {problem}"):
        grpo_settings(cfg)


def test_the_nemo_aligner_actor_refuses_an_entropy_bonus():
    cfg = {"grpo": {"entropy_coef": 0.1}, "reinforce": {"num_rollout_samples": 4}}
    with pytest.raises(ValueError, match=r"^model\.grpo\.entropy_coef: .*no entropy bonus"):
        grpo_settings(cfg)


@pytest.mark.parametrize("section", [LossSection, GRPOSettings])
def test_sections_extend_both_settings_and_hand_each_out_alone(section):
    assert issubclass(section, GRPOLossConfig) and issubclass(section, AggregationSettings)
    declared_here = set(inspect.get_annotations(section))
    assert not declared_here & set(COEFFICIENTS), "a coefficient is declared again"
    made = section(rule="token", clip_low=0.1, dual_clip=3.0, kl_coef=0.05)
    assert made.loss_config() == GRPOLossConfig(clip_low=0.1, dual_clip=3.0, kl_coef=0.05)
    assert type(made.loss_config()) is GRPOLossConfig
    assert made.aggregation_settings() == AggregationSettings(rule="token")


def test_the_recipe_keeps_its_key_order():
    """The loss section dumps the aggregation keys first, then the coefficients, as before, then
    its one nested section (the rollout correction)."""
    names = [f.name for f in fields(LossSection)]
    expected = [f.name for f in fields(AggregationSettings)] + COEFFICIENTS
    assert names == [*expected, "rollout_correction"]
