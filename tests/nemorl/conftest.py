"""tests/nemorl/: BalancedPGLossFn and run_grpo_balanced against NeMo-RL v0.7.0's own code.

    bash scripts/run_nemorl_tests.sh     # sets up .venv-nemorl, then runs these tests there

They need NeMo-RL importable; elsewhere (the main .venv) every module skips with that command as
the reason. NeMo-RL's source root goes on sys.path so that its own test fixtures import
(`tests.unit.algorithms.test_grpo`: NeMo-RL's `tests` is a regular package, which wins over this
project's namespace package of the same name).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

SETUP_HINT = "these tests run in .venv-nemorl: bash scripts/run_nemorl_tests.sh"


def nemo_rl_root() -> str:
    """The NeMo-RL source tree the environment imports (installed editable from it)."""
    import nemo_rl

    return os.path.dirname(os.path.dirname(os.path.abspath(nemo_rl.__file__)))


def _nemo_rl_installed() -> bool:
    try:
        return importlib.util.find_spec("nemo_rl.algorithms") is not None
    except ImportError:
        return False


if _nemo_rl_installed():
    sys.path.insert(0, nemo_rl_root())


@pytest.fixture(scope="session")
def gloo_world(tmp_path_factory):
    """A one-process gloo world: NeMo-RL's training step all-reduces its token counts over DP."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray started by NeMo-RL's own init_ray, as its unit-test conftest does (grpo_train's
    memory tracker asks Ray for its state)."""
    import ray
    from nemo_rl.distributed.virtual_cluster import init_ray

    init_ray()
    yield
    ray.shutdown()
