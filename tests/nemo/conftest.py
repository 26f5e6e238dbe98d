"""tests/nemo/: NeMo-Aligner 0.7.0's real classes on CPU; they run in .venv-nemo only.

    bash scripts/run_nemo_tests.sh       # sets up .venv-nemo, then runs these tests

Elsewhere (the main .venv) the tests that need NeMo skip with that command as the reason; the
contract test needs only the downloaded wheel (.nemo-wheels/).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP_HINT = "bash scripts/setup_nemo_env.sh (or bash scripts/run_nemo_tests.sh)"


def pytest_configure(config):
    config.addinivalue_line("markers", "nemo: needs .venv-nemo (NeMo 2.1, nemo-aligner 0.7.0)")


def nemo_env_reason() -> str | None:
    """Why the NeMo tests cannot run in this interpreter, or None if they can."""
    if importlib.util.find_spec("nemo_aligner") is None or importlib.util.find_spec("nemo") is None:
        return f"nemo_aligner/nemo not installed: these tests run in .venv-nemo ({SETUP_HINT})"
    from importlib.metadata import version

    got = (version("nemo_aligner"), version("megatron-core"))
    if got != ("0.7.0", "0.10.0"):
        return f"expected nemo-aligner 0.7.0 and megatron-core 0.10.0, found {got} ({SETUP_HINT})"
    return None


needs_nemo = pytest.mark.skipif(nemo_env_reason() is not None, reason=str(nemo_env_reason()))


def nemo_env() -> dict:
    """The environment of a subprocess of these tests (a NeMo run, a worker)."""
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                TOKENIZERS_PARALLELISM="false", HYDRA_FULL_ERROR="1")  # fmt: skip


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """`megatron-ba nemo-tiny-model` with a 150-step warm start (made in a subprocess: NeMo and
    its process group stay out of the test process)."""
    root = tmp_path_factory.mktemp("nemo_tiny")
    cmd = [sys.executable, "-m", "megatron_ba.cli", "nemo-tiny-model", str(root / "model"),
           "warmstart.steps=150", "--cache-dir", str(root / "cache")]  # fmt: skip
    proc = subprocess.run(cmd, env=nemo_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return root / "model"
