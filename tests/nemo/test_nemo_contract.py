"""The contract: what our subclasses use in nemo-aligner 0.7.0 exists as we rely on it.

Parses the pure-Python wheel (downloaded by scripts/setup_nemo_env.sh into .nemo-wheels/) with
`ast`; nothing is imported, so this runs in any environment that has the wheel.
"""

from __future__ import annotations

import glob
import os

import nemo_aligner_contract as contract
import pytest
from conftest import REPO, SETUP_HINT

pytestmark = pytest.mark.nemo


def _wheel() -> str | None:
    explicit = os.environ.get("MEGATRON_BA_NEMO_ALIGNER_WHEEL")
    if explicit:
        return explicit
    found = sorted(glob.glob(str(REPO / ".nemo-wheels" / "nemo_aligner-0.7.0-*.whl")))
    return found[0] if found else None


@pytest.fixture(scope="module")
def sources():
    wheel = _wheel()
    if wheel is None:
        pytest.skip(f"the nemo-aligner 0.7.0 wheel is not in .nemo-wheels/ ({SETUP_HINT})")
    return contract.read_sources(wheel)


def test_contract_holds_on_the_wheel(sources):
    assert contract.check_source(sources) == []


def _mutate(sources, module, old, new):
    assert old in sources[module], f"the mutation target {old!r} is not in {module}"
    return dict(sources, **{module: sources[module].replace(old, new, 1)})


@pytest.mark.parametrize(
    ("module", "old", "new", "expected"),
    [
        (  # a renamed parameter of a method we override
            contract.ACTOR_MODULE,
            "def get_loss_and_metrics(self, batch, forward_only):",
            "def get_loss_and_metrics(self, batch, forward_only_flag):",
            "MegatronGPTReinforceActorModel.get_loss_and_metrics has parameters",
        ),
        (  # the parent no longer calls our override
            contract.TRAINER_MODULE,
            "reinforce_rollout_metrics = self.generate_reinforce_data(rollout_batch)",
            "reinforce_rollout_metrics = {}",
            "no longer calls generate_reinforce_data",
        ),
        (  # a batch key of the rollout batch renamed
            contract.ACTOR_MODULE,
            '"prompt_lengths": prompt_lengths,',
            '"context_lengths": prompt_lengths,',
            "no longer uses the keys ['prompt_lengths']",
        ),
        (  # a config key no longer read
            contract.TRAINER_MODULE,
            "self.compute_init_policy_kl = self.cfg.initial_policy_kl_penalty > 0",
            "self.compute_init_policy_kl = self.cfg.init_kl > 0",
            "no longer reads ['self.cfg.initial_policy_kl_penalty']",
        ),
        (  # a class removed
            contract.ACTOR_MODULE,
            "class MegatronGPTReinforceActorModel(",
            "class MegatronGPTReinforceActorModelV2(",
            "MegatronGPTReinforceActorModel is missing",
        ),
        (  # a schedule call keyword dropped
            contract.TRAINER_MODULE,
            "self.model.get_loss_and_metrics(batch=batch, forward_only=False)",
            "self.model.get_loss_and_metrics(batch, False)",
            "calls get_loss_and_metrics without the keywords",
        ),
    ],
)
def test_contract_fails_clearly_on_a_mutated_copy(sources, module, old, new, expected):
    problems = contract.check_source(_mutate(sources, module, old, new))
    assert len(problems) == 1, problems
    assert expected in problems[0] and module in problems[0], problems[0]


def test_missing_file_is_reported(sources):
    partial = {k: v for k, v in sources.items() if k != contract.TRAINER_MODULE}
    problems = contract.check_source(partial)
    assert problems and all(contract.TRAINER_MODULE in p for p in problems)
