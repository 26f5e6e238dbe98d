"""NeMo-RL: BalancedPGLossFn against the core, and the contract against NeMo-RL's source (v0.7.0).

NeMo-RL is not installable here. Its protocol and call sites are checked on facts extracted by
`ast` from its source at the pinned commit (tests/fixtures/nemo_rl/contract.json, ~8 kB of names
and signatures, no code); the check is shown to fail on mutated facts and on mutated source text.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from megatron_ba.integrations.nemo_rl import BalancedPGLossFn
from megatron_ba.integrations.nemo_rl.run_grpo_balanced import balanced_setup
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.rules import AggregationSettings
from tests import nemo_rl_contract as c

FIXTURE = Path(__file__).parent / "fixtures" / "nemo_rl" / "contract.json"
# A git clone of NeMo-RL holding the pinned commit; the fixture is re-derived from it when set.
NEMO_RL_GIT = os.environ.get("MEGATRON_BA_NEMO_RL_GIT", "")


def _doc_snippet(name: str) -> str:
    """The ```python block of docs/integrations.md that starts with `# docs snippet: NAME`."""
    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    start = text.index(f"```python\n# docs snippet: {name}\n") + len("```python\n")
    return text[start : text.index("```", start)]


def _facts():
    return json.loads(FIXTURE.read_text())


def test_contract_holds_on_the_pinned_snapshot():
    facts = _facts()
    assert facts["source"] == c.PINNED
    assert c.check(facts) == []


def _rename_arg(f):
    args = f["files"][c.INTERFACES]["classes"]["LossFunction"]["methods"]["__call__"]["args"]
    args[args.index("global_valid_toks")] = "global_valid_tokens"


def _swap_setup(f):
    ret = f["files"][c.GRPO]["functions"]["setup"]["tuple_returns"]
    for r in ret:
        if len(r) > 10:
            r[5], r[6] = r[6], r[5]


MUTATIONS = {
    "protocol argument renamed": (_rename_arg, "LossFunction.__call__"),
    "enum value changed": (
        lambda f: f["files"][c.INTERFACES]["classes"]["LossInputType"]["values"].update(
            LOGPROB="log_prob"
        ),
        "LOGPROB",
    ),
    "setup result reordered": (_swap_setup, "grpo.setup returns"),
    "policy.train call changed": (
        lambda f: [
            x.update(args=["loss_fn", "train_data"])
            for x in f["files"][c.GRPO]["calls"]["policy.train"]
        ],
        "policy.train(train_data, loss_fn",
    ),
    "DP sum convention dropped": (
        lambda f: f["files"][c.AUTOMODEL_TRAIN]["assigns"].clear(),
        "dp_size",
    ),
    "wrapper keyword dropped": (
        lambda f: [
            x["keywords"].remove("global_valid_toks")
            for x in f["files"][c.WRAPPER]["calls"]["self.loss_fn"]
            if x["args"] == []
        ],
        "wrapper",
    ),
    "data key renamed": (
        lambda f: f["files"][c.LOSS_FUNCTIONS]["classes"]["ClippedPGLossFn"]["methods"]["__call__"][
            "data_keys"
        ].remove("sample_mask"),
        "sample_mask",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_contract_fails_on_a_mutated_copy(name):
    mutate, expected = MUTATIONS[name]
    facts = copy.deepcopy(_facts())
    mutate(facts)
    problems = c.check(facts)
    assert len(problems) == 1 and expected in problems[0], problems


# A protocol written here in NeMo-RL's shape (not its code): the extractor reads source text.
PROTOCOL = """
import enum
from typing import Any, Protocol
class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
class LossInputType(enum.Enum):
    LOGPROB = "logprob"
class LossFunction(Protocol):
    loss_type: LossType
    input_type: LossInputType
    def __call__(self, data, global_valid_seqs, global_valid_toks, **kwargs: Any):
        ...
"""


def test_extractor_reads_source_and_a_mutated_source_fails():
    facts = _facts()
    facts["files"][c.INTERFACES] = c.extract_file(PROTOCOL)
    assert c.check(facts) == []
    facts["files"][c.INTERFACES] = c.extract_file(PROTOCOL.replace(", **kwargs: Any", ""))
    assert c.check(facts) == [
        "LossFunction.__call__(self, data, global_valid_seqs, global_valid_toks, **kwargs)"
    ]


@pytest.mark.skipif(
    not os.path.isdir(NEMO_RL_GIT), reason="MEGATRON_BA_NEMO_RL_GIT names no NeMo-RL git clone"
)
def test_fixture_is_what_the_pinned_source_gives():
    assert c.extract_from_git(NEMO_RL_GIT, c.PINNED["commit"]) == _facts()


# --- numerics ------------------------------------------------------------------------------------

G, PROMPT, SEQ = 4, 3, 12


def _data(seed=0, num_groups=3):
    """A NeMo-RL GRPO train batch: token_mask over responses, advantages repeated on tokens."""
    g = torch.Generator().manual_seed(seed)
    n = G * num_groups
    resp = torch.randint(1, SEQ - PROMPT + 1, (n,), generator=g)
    pos = torch.arange(SEQ)[None, :]
    token_mask = ((pos >= PROMPT) & (pos < PROMPT + resp[:, None])).float()
    sample_mask = torch.ones(n)
    sample_mask[5] = 0.0  # e.g. an overlong response, filtered
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    grouped = rewards.view(-1, G)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1)
    return {
        "input_ids": torch.randint(0, 100, (n, SEQ), generator=g),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": adv[:, None].expand(n, SEQ).clone(),
        "prev_logprobs": -torch.rand(n, SEQ, generator=g, dtype=torch.float64),
        "reference_policy_logprobs": -torch.rand(n, SEQ, generator=g, dtype=torch.float64),
        "_noise": 0.3 * torch.randn(n, SEQ - 1, generator=g, dtype=torch.float64),
    }, adv


CFG = {
    "ba_rule": "balanced",
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "ratio_clip_c": 3.0,
    "reference_policy_kl_penalty": 0.05,
}


def _rows(d, rows):
    return {k: v[rows] for k, v in d.items()}


def _nemo_total(loss_fn, data, logp, splits, *, plan_each=False):
    """NeMo-RL's convention: micro-batch losses summed, x dp_size, then the DP mean = their sum."""
    total = 0.0
    for rows in splits:
        mb = _rows(data, rows)
        if plan_each:
            loss_fn.attach_plan(mb)
        loss, metrics = loss_fn(logp[rows], mb, torch.tensor(0.0), torch.tensor(0.0))
        assert set(metrics) >= {"loss", "pg_loss", "ba_weight_pos_sum"}
        total = total + loss
    return total


@pytest.mark.parametrize("rule", ["balanced", "balanced_mass", "token", "sequence"])
def test_balanced_pg_loss_matches_core_on_micro_batches(rule):
    data, adv = _data()
    loss_fn = BalancedPGLossFn(CFG | {"ba_rule": rule}, group_size=G)
    loss_fn.attach_plan(data)
    logp = (data["prev_logprobs"][:, 1:] + data["_noise"]).requires_grad_(True)
    splits = [torch.tensor(r) for r in ([0, 1, 2], [3, 4, 5, 6], [7, 8], [9, 10, 11])]
    total = _nemo_total(loss_fn, data, logp, splits)
    (grad,) = torch.autograd.grad(total, logp)

    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    plan = LossPlan.build(AggregationSettings(rule), mask.sum(1), adv, torch.arange(len(adv)) // G)
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref, _ = grpo_loss(
        ref_logp,
        data["prev_logprobs"][:, 1:],
        mask.bool(),
        plan,
        GRPOLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05),
        ref_logprobs=data["reference_policy_logprobs"][:, 1:],
    )
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)

    # Negative control: planning each micro-batch (whole groups here, so that it can be planned)
    # on its own, as a per-micro-batch normalisation does, does not add up.
    whole_groups = [torch.arange(i, i + G) for i in range(0, len(adv), G)]
    other = _nemo_total(loss_fn, dict(data), logp, whole_groups, plan_each=True)
    assert abs(float(other.detach() - ref.detach())) > 1e-4


def test_loss_without_plan_and_bad_config_are_refused():
    data, _ = _data()
    loss_fn = BalancedPGLossFn(CFG, group_size=G)
    with pytest.raises(ValueError, match="attach_plan"):
        loss_fn(data["prev_logprobs"][:, 1:], data)
    with pytest.raises(ValueError, match=r"loss_fn\.ba_rule"):
        BalancedPGLossFn(CFG | {"ba_rule": "mean"}, group_size=G)
    with pytest.raises(ValueError, match="reference_policy_kl_type"):
        BalancedPGLossFn(CFG | {"reference_policy_kl_type": "k1"}, group_size=G)
    with pytest.raises(ValueError, match="whole groups"):
        BalancedPGLossFn(CFG, group_size=5).attach_plan(data)


def test_entry_script_swaps_the_loss_and_plans_before_train():
    seen = {}

    class Policy:
        def train(self, data, loss_fn, timer=None):
            seen["weights"] = data.get("ba_weights")
            return {}

    master = {
        "grpo": {"num_generations_per_prompt": G, "num_prompts_per_step": 3},
        "policy": {"train_global_batch_size": 3 * G},
        "loss_fn": CFG,
    }

    def setup(*args, **kwargs):  # the 13-tuple shape checked by the contract test
        out = [None] * 13
        out[0], out[6], out[10] = Policy(), "clipped", master
        return tuple(out)

    result = balanced_setup(setup)()
    policy, loss_fn = result[0], result[6]
    assert isinstance(loss_fn, BalancedPGLossFn) and loss_fn.group_size == G
    data, _ = _data()
    policy.train(data, loss_fn, timer=None)
    assert seen["weights"] is not None and seen["weights"].shape == (3 * G,)
    master["policy"]["train_global_batch_size"] = 6 * G
    with pytest.raises(ValueError, match="train_global_batch_size"):
        balanced_setup(setup)()


def test_docs_snippet_runs():
    namespace: dict = {}
    exec(compile(_doc_snippet("nemo_rl"), "docs/integrations.md", "exec"), namespace)
    loss, data = namespace["loss"], namespace["data"]
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert data["ba_weights"].shape == (4,)


@pytest.mark.parametrize(
    ("key", "step"),
    [
        ("token_mask", "attach_plan"),
        ("sample_mask", "attach_plan"),
        ("advantages", "attach_plan"),
        ("prev_logprobs", "loss"),
        ("reference_policy_logprobs", "loss"),  # CFG has a KL term
        ("advantages", "loss"),
    ],
)
def test_missing_data_keys_are_named(key, step):
    data, _ = _data()
    loss_fn = BalancedPGLossFn(CFG, group_size=G)
    if step == "loss":
        loss_fn.attach_plan(data)
    del data[key]
    with pytest.raises(ValueError, match=rf"data: missing \['{key}'\]"):
        if step == "attach_plan":
            loss_fn.attach_plan(data)
        else:
            loss_fn(data["prev_logprobs" if key != "prev_logprobs" else "advantages"][:, 1:], data)


def test_reference_logprobs_are_not_needed_without_kl():
    data, _ = _data()
    loss_fn = BalancedPGLossFn(CFG | {"reference_policy_kl_penalty": 0.0}, group_size=G)
    loss_fn.attach_plan(data)
    del data["reference_policy_logprobs"]
    loss, _ = loss_fn(data["prev_logprobs"][:, 1:], data)
    assert torch.isfinite(loss)


def test_plan_of_another_batch_is_refused():
    """Weights attached to the global batch but not sliced with it (one per global row)."""
    data, _ = _data()
    loss_fn = BalancedPGLossFn(CFG, group_size=G)
    loss_fn.attach_plan(data)
    micro = {k: (v if k in ("ba_weights", "ba_reg_weights") else v[:4]) for k, v in data.items()}
    with pytest.raises(ValueError, match=r"data\['ba_weights'\]: must hold one weight per row"):
        loss_fn(micro["prev_logprobs"][:, 1:], micro)


# ClippedPGLossFn settings that BalancedPGLossFn would otherwise ignore (CFG has a KL term).
IGNORED_CONFIG = {
    "token_level_loss": False,
    "force_on_policy_ratio": True,
    "disable_ppo_ratio": True,
    "use_cispo": True,
    "sequence_level_importance_ratios": True,
    "use_importance_sampling_correction": True,
    "reference_policy_kl_type": "k1",
    "use_on_policy_kl_approximation": True,
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
}


@pytest.mark.parametrize("key", sorted(IGNORED_CONFIG))
def test_config_keys_the_loss_would_ignore_are_refused(key):
    with pytest.raises(ValueError, match=rf"^loss_fn\.{key}: BalancedPGLossFn supports only"):
        BalancedPGLossFn(CFG | {key: IGNORED_CONFIG[key]}, group_size=G)


def test_kl_only_keys_are_free_without_kl():
    no_kl = CFG | {"reference_policy_kl_penalty": 0.0, "use_on_policy_kl_approximation": True}
    BalancedPGLossFn(no_kl | {"kl_input_clamp_value": 20.0}, group_size=G)
    BalancedPGLossFn(CFG | {"token_level_loss": True, "kl_input_clamp_value": None}, group_size=G)
