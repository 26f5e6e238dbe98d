"""A checkout's environment (scripts/setup_env.sh, scripts/env_lib.sh) as a new user meets it.

    python -m pytest tests/test_environments.py      # ~20 s: two clones set up over the cache

- Two clones on one machine, on different commits, share the cached dependencies
  (~/.cache/megatron-ba/envs) but each clone's `.venv` imports that clone's code, whichever clone
  was set up last; the console script `megatron-ba` and torch's `torchrun` in `.venv/bin` run
  that `.venv`'s interpreter. The control installs clone B into clone A's `.venv` and the same
  probe reports B's code.
- After `. .venv/bin/activate` in a shell that has nothing else (`env -i`), the README's
  commands `megatron-ba` and `torchrun` are on the PATH.

Both need this checkout's `.venv` set up over the cache (its `.venv/shared-env` names the cached
folder) and skip otherwise (e.g. under MEGATRON_BA_VENV=DIR, which builds no cache).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The files whose hash names the cached environment (scripts/setup_env.sh's inputs) and the library
# that sets it up: copied from this working tree into each clone, so an uncommitted change to them
# finds the environment this checkout was set up with instead of building a new one.
ENV_INPUTS = ("requirements/torch-cpu.txt", "requirements/cpu.txt", "scripts/setup_env.sh",
              "scripts/env_lib.sh")  # fmt: skip
# Where megatron_ba comes from, and whether it has the module that only clone b's commit adds.
PROBE = (
    "import importlib.util, megatron_ba; print(megatron_ba.__file__); "
    "print(importlib.util.find_spec('megatron_ba.clone_b_mark') is not None)"
)


def _shared_env() -> Path:
    marker = ROOT / ".venv" / "shared-env"
    if not marker.is_file():
        pytest.skip(
            f"{ROOT}/.venv is not set up over the cache (no {marker}): bash scripts/setup_env.sh"
        )
    shared = Path(marker.read_text().strip())
    if not (shared / ".complete").is_file():
        pytest.skip(f"the cached environment {shared} is not complete: bash scripts/setup_env.sh")
    return shared


def _made_by(shared: Path) -> str:
    """The interpreter that built the cached environment (its pyvenv.cfg's `executable`)."""
    lines = (shared / "pyvenv.cfg").read_text().splitlines()
    return next(line.split("=", 1)[1].strip() for line in lines if line.startswith("executable"))


def _cache_folder(checkout: Path, env: dict) -> Path:
    """The cached folder scripts/setup_env.sh would use in `checkout` (its inputs' hash)."""
    inputs = " ".join(ENV_INPUTS[:3])
    script = f'. scripts/env_lib.sh && cached_env_path main "$PYTHON" {inputs}'
    return Path(_run(["bash", "-c", script], cwd=checkout, env=env).strip())


def _plain_env(**extra: str) -> dict:
    """The environment of a new shell: no active virtual environment, no project variables."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items()
           if k not in dropped and not k.startswith("MEGATRON_BA_")}  # fmt: skip
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (
        f"{' '.join(cmd)} in {cwd}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    )
    return p.stdout


def _clone(dest: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, timeout=120)
    for name in ENV_INPUTS:
        shutil.copy2(ROOT / name, dest / name)
    return dest


def _imported_from(checkout: Path, env: dict) -> tuple[Path, bool]:
    """(megatron_ba's file, whether clone b's commit is what it imports) in checkout's .venv."""
    where, has_mark = _run([str(checkout / ".venv/bin/python"), "-c", PROBE], cwd=Path("/"),
                           env=env).split()  # fmt: skip
    return Path(where).resolve(), has_mark == "True"


def _fresh_shell(script: str, **env: str) -> subprocess.CompletedProcess:
    """bash -c SCRIPT in this checkout, in a shell with only PATH=/usr/bin:/bin and env."""
    cmd = ["env", "-i", "PATH=/usr/bin:/bin", *(f"{k}={v}" for k, v in env.items()), "bash", "-c"]
    return subprocess.run([*cmd, script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _head(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()  # fmt: skip


def _commit_in_b(b: Path) -> None:
    """Clone b one commit ahead of a: a module a does not have."""
    (b / "megatron_ba/clone_b_mark.py").write_text('"""Only in clone b\'s commit."""\n')
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run([*git, "add", "-A"], cwd=b, check=True, timeout=60)
    subprocess.run([*git, "commit", "-q", "-m", "b's own change"], cwd=b, check=True, timeout=60)


def test_two_clones_sharing_the_cache_each_import_their_own_code(tmp_path):
    shared = _shared_env()
    env = _plain_env(MEGATRON_BA_ENV_CACHE=str(shared.parent), PYTHON=_made_by(shared))
    if _cache_folder(ROOT, env) != shared:  # never build (and drop this checkout's) in a test
        pytest.skip(f"{ROOT}/.venv stands on an outdated {shared}: bash scripts/setup_env.sh")
    a, b = _clone(tmp_path / "a"), _clone(tmp_path / "b")
    _commit_in_b(b)
    assert _cache_folder(a, env) == shared, "ENV_INPUTS is not scripts/setup_env.sh's inputs"
    for checkout in (a, b):  # b last: the set-up that used to take the shared environment over
        out = _run(["bash", "scripts/setup_env.sh"], cwd=checkout, env=env)
        assert f"{shared} is up to date" in out  # the cache served both: nothing was built
        assert (checkout / ".venv/shared-env").read_text().strip() == str(shared)
    assert _head(a) != _head(b)
    for checkout, is_b in ((a, False), (b, True)):
        where, has_mark = _imported_from(checkout, env)
        assert where.is_relative_to(checkout.resolve()) and has_mark == is_b, (checkout, where)
        for script in ("megatron-ba", "torchrun", "pytest"):
            shebang = (checkout / ".venv/bin" / script).read_text().splitlines()[0]
            interpreter = Path(shebang.removeprefix("#!"))  # .venv/bin/python or python3.11
            assert interpreter.parent == checkout / ".venv/bin", (script, shebang)
            assert interpreter.name.startswith("python") and interpreter.exists(), shebang
    # control: clone b installed into clone a's .venv, and the probe sees b's code in a
    _run([str(a / ".venv/bin/python"), "-m", "pip", "install", "-q", "--no-deps", "-e", str(b)],
         cwd=a, env=env)  # fmt: skip
    assert _imported_from(a, env) == (b.resolve() / "megatron_ba/__init__.py", True)


def test_activating_the_venv_puts_the_commands_on_the_path():
    _shared_env()
    shell = (". .venv/bin/activate && command -v megatron-ba torchrun"
             " && megatron-ba --help && torchrun --help")  # fmt: skip
    p = _fresh_shell(shell, HOME=str(Path.home()))
    assert p.returncode == 0, p.stderr[-3000:]
    found = p.stdout.splitlines()[:2]
    assert found == [f"{ROOT}/.venv/bin/megatron-ba", f"{ROOT}/.venv/bin/torchrun"], found
    assert "usage: megatron-ba" in p.stdout and "usage: torchrun" in p.stdout
    # control: the same shell without the activation finds neither
    p = _fresh_shell("command -v megatron-ba torchrun", HOME=str(Path.home()))
    assert p.returncode != 0 and not p.stdout
