"""Distributed checkpoints across the two megatron-core releases the project runs on.

    bash scripts/run_current_tests.sh tests/test_checkpoint_versions.py   # needs .venv too

megatron-core 0.16.1 (.venv) writes a checkpoint's common state to `common.pt`; 0.19 (.venv-current)
writes it inside the `.distcp` files and still reads `common.pt`. So a checkpoint moves from the
CPU stack to the current one (bit for bit), and the other way 0.16.1 refuses it with an error
that says why and what to do (it used to fail with a FileNotFoundError inside its loader).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = {"0.16": ROOT / ".venv/bin/python", "0.19": ROOT / ".venv-current/bin/python"}


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _mcore_version(python: Path) -> str:
    code = "from megatron.core import package_info; print(package_info.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.fixture(scope="module")
def pythons() -> dict[str, Path]:
    if Path(sys.prefix).resolve() != PYTHONS["0.19"].parent.parent.resolve():
        # The main suite runs while .venv-current may still be building (scripts/run_tests.sh).
        pytest.skip("runs in the current-stack suite: bash scripts/run_current_tests.sh")
    missing = [str(p) for p in PYTHONS.values() if not p.exists()]
    if missing:
        pytest.skip(
            f"needs both environments ({', '.join(missing)} missing): bash scripts/setup_env.sh "
            "and bash scripts/setup_current_env.sh"
        )
    for want, python in PYTHONS.items():
        assert _mcore_version(python).startswith(want + "."), python
    return PYTHONS


def _cli(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "megatron_ba.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def checkpoints(pythons, tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    ok = _cli(pythons["0.16"], "tiny-model", str(root / "hf"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    for version, python in pythons.items():
        ok = _cli(
            python, "convert", str(root / "hf"), str(root / f"m{version}"), "--to", "megatron"
        )
        assert ok.returncode == 0, ok.stderr[-3000:]
    return root


def test_the_two_releases_write_the_common_state_differently(checkpoints):
    assert (checkpoints / "m0.16" / "common.pt").is_file()
    assert not (checkpoints / "m0.19" / "common.pt").exists()


def test_a_0_16_checkpoint_loads_on_0_19_bit_for_bit(pythons, checkpoints):
    out = _cli(
        pythons["0.19"],
        "convert",
        str(checkpoints / "m0.16"),
        str(checkpoints / "back"),
        "--to",
        "hf",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    source, back = _tensors(checkpoints / "hf"), _tensors(checkpoints / "back")
    assert source.keys() == back.keys()
    assert all(torch.equal(source[k], back[k]) for k in source)


def test_a_0_19_checkpoint_on_0_16_is_refused_with_the_reason(pythons, checkpoints):
    out = _cli(
        pythons["0.16"],
        "convert",
        str(checkpoints / "m0.19"),
        str(checkpoints / "no"),
        "--to",
        "hf",
    )
    assert out.returncode != 0
    assert "keeps its common state inside its .distcp files" in out.stderr
    assert "megatron-core 0.16.1 cannot read" in out.stderr
    assert "FileNotFoundError" not in out.stderr


def test_the_readability_check_follows_the_feature_not_the_version(monkeypatch, tmp_path):
    """In this process's megatron-core, whichever it is: a folder without common.pt is refused
    exactly when the reader lacks the in-checkpoint common state."""
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing import serialization

    from megatron_ba.megatron.mcore_compat import check_checkpoint_readable

    monkeypatch.setattr(serialization, "_legacy_common_state_exists", None, raising=False)
    check_checkpoint_readable(tmp_path)  # a reader that knows both layouts
    monkeypatch.delattr(serialization, "_legacy_common_state_exists")
    with pytest.raises(ValueError, match=r"keeps its common state inside its \.distcp files"):
        check_checkpoint_readable(tmp_path)
    (tmp_path / "common.pt").write_bytes(b"")
    check_checkpoint_readable(tmp_path)  # the layout every reader knows
