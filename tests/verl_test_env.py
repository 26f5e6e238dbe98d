"""The verl tests' clean environment: an autouse fixture that removes the MEGATRON_BA_* variables
(python -m megatron_ba.integrations.verl.main_ppo exports them) and restores them, and
VERL_USE_EXTERNAL_MODULES, after each test. A test module uses it by importing it:

    from verl_test_env import no_ba_environment  # noqa: F401 (autouse fixture)
"""

from __future__ import annotations

import os

import pytest

BA_ENV = ("MEGATRON_BA_SCOPE", "MEGATRON_BA_NEUTRAL_EPS", "MEGATRON_BA_STEPS_PER_BATCH")


@pytest.fixture(autouse=True)
def no_ba_environment(monkeypatch):
    """No MEGATRON_BA_* variable; whatever main_ppo exports is undone after each test."""
    for name in (*BA_ENV, "VERL_USE_EXTERNAL_MODULES"):
        value = os.environ.get(name)
        monkeypatch.setenv(name, "")  # recorded: teardown restores the value (or its absence)
        if name in BA_ENV or value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
