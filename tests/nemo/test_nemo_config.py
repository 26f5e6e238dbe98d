"""The NeMo-Aligner config's `model.grpo` section against the REINFORCE keys it replaces.

Runs anywhere (config.py imports no NeMo): the shipped conf/gpt_grpo_balanced.yaml passes; each
wrong pairing is refused with the key named, where train_grpo (`check_config`), the actor
(`grpo_settings`) or the trainer (`check_reinforce_keys`) would otherwise train on defaults or
drop a setting silently.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from conftest import REPO

from megatron_ba.integrations.nemo_aligner.config import check_config, grpo_settings

CONF = REPO / "megatron_ba/integrations/nemo_aligner/conf/gpt_grpo_balanced.yaml"


@pytest.fixture(scope="module")
def shipped() -> dict:
    return yaml.safe_load(CONF.read_text())


def _set(cfg: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(cfg)
    node = out
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return out


_DELETE = object()


def test_shipped_config_passes(shipped):
    settings = check_config(shipped)
    assert settings.rule == "balanced"
    assert settings.num_groups == shipped["model"]["reinforce"]["num_rollout_samples"]
    # an explicit num_groups equal to the prompts per step is the same setting
    same = _set(shipped, "model.grpo.num_groups", settings.num_groups)
    assert check_config(same) == settings
    assert grpo_settings({"grpo": {}, "reinforce": {"num_rollout_samples": 4}}).rule == "balanced"


def test_every_core_rule_is_a_rule_key(shipped):
    """model.grpo.rule takes group_token_mean (whatever model.grpo.scope) into the actor's plan
    settings; an unknown rule is refused naming the key (the control)."""
    cfg = _set(_set(shipped, "model.grpo.rule", "group_token_mean"), "model.grpo.scope", "batch")
    plan = check_config(cfg).aggregation_settings()
    assert (plan.rule, plan.scope) == ("group_token_mean", "batch")
    with pytest.raises(ValueError, match=r"^model\.grpo\.rule: must be one of .*group_token_mean"):
        check_config(_set(shipped, "model.grpo.rule", "group_mean"))


# (dotted key, value, fragments the error must contain)
WRONG = {
    "reinforce_config_without_grpo": (
        "model.grpo", _DELETE, ["model.grpo: missing", "gpt_grpo_balanced.yaml"],
    ),
    "kl_in_reward": (
        "trainer.reinforce.initial_policy_kl_penalty", 0.01,
        ["trainer.reinforce.initial_policy_kl_penalty", "model.grpo.kl_coef"],
    ),
    "group_of_one": (
        "trainer.reinforce.num_rollouts_per_prompt", 1,
        ["trainer.reinforce.num_rollouts_per_prompt", "2 or more"],
    ),
    "num_groups_not_prompts_per_step": (
        "model.grpo.num_groups", 16,
        ["model.grpo.num_groups", "num_rollout_samples", "is 32", "num_groups=null"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_pairing_is_refused(shipped, case):
    key, value, fragments = WRONG[case]
    with pytest.raises(ValueError) as err:
        check_config(_set(shipped, key, value))
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize(
    "case", ["reinforce_config_without_grpo", "num_groups_not_prompts_per_step"]
)
def test_the_actor_refuses_its_half(shipped, case):
    """The actor reads model.grpo itself (grpo_settings): the same refusals without train_grpo."""
    key, value, fragments = WRONG[case]
    with pytest.raises(ValueError, match=fragments[0]):
        grpo_settings(_set(shipped, key, value)["model"])
