"""Training recipes: one YAML format for every backend, loaded strictly, with key=value overrides.

    recipe = load_recipe("recipes/tiny-cpu.yaml", ["loss.rule=token", "grpo.steps=20"])
    recipe.loss.rule, recipe.parallel.layout(), recipe.to_dict(), recipe.dump(path)

The package: `schema` (the sections and the Recipe: docs/recipes.md lists every key), `loading`
(YAML, overrides, strict types), `validation` (the cross-field rules). Loading a recipe imports no
torch, no framework and no data code.
"""

from megatron_ba.recipe.loading import NOT_IMPLEMENTED, apply_overrides, load_recipe, parse_override
from megatron_ba.recipe.schema import (
    TINY_SHAPE,
    VLLM_GPU_MEMORY_UTILIZATION,
    CheckpointSection,
    DataSection,
    EvalSection,
    GRPOSection,
    LoggingSection,
    LossSection,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    Recipe,
    RecipeError,
    RewardSection,
    RolloutSection,
    RopeScalingSection,
    TokenizerSection,
    WandbSection,
    WarmstartSection,
)
from megatron_ba.recipe.validation import BENCHMARK_NAMES, MATH_TEMPLATE_NAMES, validate

__all__ = [
    "BENCHMARK_NAMES",
    "MATH_TEMPLATE_NAMES",
    "NOT_IMPLEMENTED",
    "TINY_SHAPE",
    "VLLM_GPU_MEMORY_UTILIZATION",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "GRPOSection",
    "LoggingSection",
    "LossSection",
    "ModelSection",
    "OptimizerSection",
    "ParallelSection",
    "Recipe",
    "RecipeError",
    "RewardSection",
    "RolloutSection",
    "RopeScalingSection",
    "TokenizerSection",
    "WandbSection",
    "WarmstartSection",
    "apply_overrides",
    "load_recipe",
    "parse_override",
    "validate",
]
