"""A light install of megatron-ba: the wheel of this repository alone, in a copy of an environment
from which the packages a drop-in must not need (megatron-core, vLLM, ...) are left out.

    python tests/light_install.py --venv .venv-verl --hide datasets -- verl nemo_rl cli
    python tests/light_install.py --venv .venv --hide megatron vllm -- trl nemo_rl

builds the wheel, makes the light environment of VENV and runs the named checks of
tests/light_probe.py in it (`cli`: `megatron-ba --help` and every subcommand's `--help`); exit
status 1 when one fails, with what failed. The pieces, for a test of another environment:

1. `build_wheel(out)`: `pip wheel --no-deps --no-build-isolation --no-index` of a copy of the
   package's files (pyproject.toml, README.md, megatron_ba/) made in `out`, so the checkout gets no
   build/ or egg-info; the running interpreter's setuptools builds it (>= 70.1: no `wheel` needed).
2. `light_env(venv, wheel, dest, hide)`: a new virtual environment in `dest`, made by VENV's own
   interpreter (for a checkout's environment over a cached one, scripts/env_lib.sh, the cached
   one's), whose site-packages links to every entry of VENV's site-packages except
   megatron-ba's own install (the checkout's editable one) and the files of each distribution that
   provides a top-level module named in `hide` (read from the distributions' RECORD files); then
   pip installs the wheel into it, console script included. Why this stands for an environment
   that never had them: the left-out packages are absent as files (`find_spec` returns None,
   `importlib.metadata` does not list them, no import hook is involved), and every other package
   is VENV's own file, at the same relative place.
3. `run_probe(env, checks, absent)` (`start_probe` to run several at once): tests/light_probe.py
   CHECKS (`verl`, `trl`, ..., `import:MODULE`) run by the light environment's Python with `-I`
   (no PYTHONPATH; neither the checkout nor the probe's folder on sys.path); `run_cli_help(env)`:
   the console script's `--help` of every command, none importing torch, megatron-core or vLLM.

Stdlib only: the runner may be any Python >= 3.11 with setuptools >= 70.1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "light_probe.py"
# What a wheel is built from (pyproject.toml's build reads no other file).
PACKAGE_FILES = ("pyproject.toml", "README.md", "megatron_ba")
TIMEOUT_S = 300
HEAVY = ("torch", "megatron", "vllm", "transformers")  # what `--help` must not import


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout's package, built in `out` (a copy of its files); its path."""
    src, dist = Path(out) / "src", Path(out) / "dist"
    src.mkdir(parents=True)
    for name in PACKAGE_FILES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    _run([*cmd, "--no-index", "-q", "-w", str(dist), str(src)], "pip wheel")
    (wheel,) = dist.glob("megatron_ba-*.whl")
    return wheel


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
    return p


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run([str(python), "-I", "-c", code], "sysconfig").stdout.strip())


def _distributions(site: Path) -> dict[str, set[str]]:
    """dist-info folder name -> the top-level entries of `site` its RECORD lists (itself too)."""
    owned = {}
    for info in site.glob("*.dist-info"):
        tops = {info.name}
        record = info / "RECORD"
        if record.is_file():
            for line in record.read_text().splitlines():
                top = line.split(",", 1)[0].split("/", 1)[0]
                if top and top not in ("..", "__pycache__"):
                    tops.add(top)
        owned[info.name] = tops
    return owned


def left_out(site: Path, hide: list[str]) -> tuple[set[str], list[str]]:
    """(entries of `site` to leave out, the distributions they belong to): megatron-ba's own and
    those of every distribution that provides one of the top-level modules `hide`."""
    skip, dists = set(), []
    for info, tops in sorted(_distributions(site).items()):
        is_ours = info.lower().startswith("megatron_ba-")
        provides = {t.removesuffix(".py") for t in tops} & set(hide)
        if is_ours or provides:
            skip |= tops
            dists.append(info.removesuffix(".dist-info"))
    # By name too: an editable install being rewritten (another checkout's set-up) may have its
    # .pth and finder in place while its dist-info (and so its RECORD) is not.
    skip |= {e.name for e in site.iterdir() if "megatron_ba" in e.name}
    return skip, dists


def light_env(venv: Path, wheel: Path, dest: Path, hide: list[str]) -> list[str]:
    """Make the light environment of `venv` in the new folder `dest`, with `wheel` installed; the
    distributions left out. A `hide` module that `venv` does not have is simply absent."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"venv: {venv} has no bin/python (not a virtual environment?)")
    if (Path(venv) / "shared-env").is_file():  # a checkout's environment: its packages are there
        python = Path((Path(venv) / "shared-env").read_text().strip()) / "bin" / "python"
    site = _purelib(python)
    _run([str(python), "-I", "-m", "venv", "--without-pip", str(dest)], "python -m venv")
    new_site = Path(dest) / site.relative_to(_prefix(python))
    skip, dists = left_out(site, hide)
    for entry in site.iterdir():
        if entry.name not in skip and entry.name != "__pycache__":
            (new_site / entry.name).symlink_to(entry)
    pip = [str(Path(dest) / "bin" / "python"), "-I", "-m", "pip", "install", "--no-deps"]
    _run([*pip, "--no-index", "-q", str(wheel)], "pip install of the wheel", env=_clean_env())
    return dists


def _prefix(python: Path) -> Path:
    code = "import sys; print(sys.prefix)"
    return Path(_run([str(python), "-I", "-c", code], "sys.prefix").stdout.strip())


def _clean_env(**extra: str) -> dict[str, str]:
    """os.environ without Python's own variables (PYTHONPATH, ...), the user's site-packages nor
    pip's version check, offline for Hugging Face; plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def start_probe(env: Path, checks: list[str], absent: list[str], cwd: Path) -> subprocess.Popen:
    """Start tests/light_probe.py CHECKS in the light environment `env` (its folder), one process,
    in the working directory `cwd`; the probe also checks that no module of `absent` is found.
    `.communicate()` gives (stdout, stderr)."""
    python = str(Path(env) / "bin" / "python")
    cmd = [python, "-I", str(PROBE), *checks, "--absent", ",".join(absent)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=_clean_env()
    )


def run_probe(env: Path, checks: list[str], absent: list[str]) -> subprocess.CompletedProcess:
    """start_probe, from a temporary working directory, and its result."""
    with tempfile.TemporaryDirectory(prefix="megatron-ba-probe-") as cwd:
        p = start_probe(env, checks, absent, Path(cwd))
        out, err = p.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_bench(env: Path) -> list[str]:
    """`megatron-ba perf aggregation` (a small size) by the installed console script, from a
    folder outside the checkout: the performance benchmarks ship in the wheel (megatron_ba.perf).
    The failures as messages."""
    argv = ["perf", "aggregation", "--sequences", "32", "--max-length", "64", "--repeats", "1"]
    with tempfile.TemporaryDirectory(prefix="megatron-ba-bench-") as cwd:
        p = subprocess.run(
            [str(Path(env) / "bin" / "megatron-ba"), *argv, "--json"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=cwd,
            env=_clean_env(),
        )
    if p.returncode != 0 or not p.stdout.strip().startswith("{"):
        return [f"megatron-ba {' '.join(argv)} --json: exit {p.returncode}\n{p.stdout}{p.stderr}"]
    return []


def run_cli_help(env: Path, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """`megatron-ba --help` and `megatron-ba COMMAND --help` for every command, by the installed
    console script; the failures (a non-zero exit, no usage line, or a `heavy` module imported,
    seen with PYTHONPROFILEIMPORTTIME) as messages."""
    script = str(Path(env) / "bin" / "megatron-ba")
    code = "from megatron_ba.cli import COMMANDS; print(' '.join(COMMANDS))"
    python = str(Path(env) / "bin" / "python")
    commands = _run([python, "-I", "-c", code], "listing the commands").stdout.split()
    failures = []
    with tempfile.TemporaryDirectory(prefix="megatron-ba-cli-") as cwd:
        for argv in [["--help"], *([c, "--help"] for c in commands)]:
            p = subprocess.run(
                [script, *argv],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                cwd=cwd,
                env=_clean_env(PYTHONPROFILEIMPORTTIME="1"),
            )
            imported = {
                line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in p.stderr.splitlines()
                if line.startswith("import time:") and "|" in line
            }
            what = f"megatron-ba {' '.join(argv)}"
            if p.returncode != 0 or "usage:" not in p.stdout:
                failures.append(f"{what}: exit {p.returncode}\n{p.stdout}{_errors(p.stderr)}")
            elif imported & set(heavy):
                failures.append(f"{what}: imported {sorted(imported & set(heavy))}")
    return failures


def _errors(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", required=True, type=Path, help="the environment to copy")
    parser.add_argument("--hide", nargs="*", default=[], help="top-level modules to leave out")
    parser.add_argument("--wheel", type=Path, help="a wheel built before (default: build one)")
    parser.add_argument(
        "checks", nargs="+", help="checks of tests/light_probe.py (verl, trl, ..., import:MODULE) "
        "and `cli` (the console script's --help, and `megatron-ba perf` from the wheel)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.venv / "bin" / "python").exists():
        parser.error(f"--venv: {args.venv} has no bin/python (not a virtual environment?)")
    if args.wheel and not args.wheel.is_file():
        parser.error(f"--wheel: {args.wheel} is not a file")
    probe_checks = [c for c in args.checks if c != "cli"]
    with tempfile.TemporaryDirectory(prefix="megatron-ba-light-") as tmp:
        wheel = args.wheel or build_wheel(Path(tmp) / "wheel")
        env = Path(tmp) / "env"
        dists = light_env(args.venv, wheel, env, args.hide)
        print(f"[light] {args.venv} without {', '.join(dists)}; {wheel.name} installed")
        failures = run_cli_help(env) + run_bench(env) if "cli" in args.checks else []
        if probe_checks:
            p = run_probe(env, probe_checks, args.hide)
            failures += [] if p.returncode == 0 else [p.stdout + p.stderr]
    for failure in failures:
        print(failure)
    print(f"[light] {' '.join(args.checks)}: {'FAILED' if failures else 'ok'}")
    return int(bool(failures))


if __name__ == "__main__":
    sys.exit(main())
