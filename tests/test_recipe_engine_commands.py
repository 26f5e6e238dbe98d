"""The engine commands in the recipes' headers (`#   verl: ...`, `#   NeMo-RL: ...`: what a cluster
user types to run the recipe on verl or NeMo-RL through slurm/grpo_balanced.sh) translate as
written: the same arguments with `--print-overrides` leave `megatron-ba train` with status 0.
The control: a header command without a key NeMo-RL needs (eval.samples=1) is refused."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^#   (verl|NeMo-RL): +(.*)$", re.M)


def _commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        for engine, line in HEADER.findall(path.read_text()):
            words = shlex.split(line)
            script = words.index("slurm/grpo_balanced.sh")
            found.append((path.stem, engine, words[script + 1 :]))
    return found


COMMANDS = _commands()


def _translate(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ba.cli", "train", *args,
                           "--print-overrides"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_paper_recipes_name_both_engines():
    named = {(name, engine) for name, engine, _ in COMMANDS}
    for name in ("qwen3-1.7b-dapo17k", "qwen2.5-math-7b-dapo17k"):
        assert {(name, "verl"), (name, "NeMo-RL")} <= named


@pytest.mark.parametrize(
    ("name", "engine", "args"), COMMANDS, ids=[f"{n}-{e}" for n, e, _ in COMMANDS]
)
def test_a_header_command_translates(name, engine, args):
    assert args[0] == f"recipes/{name}.yaml"
    assert f"backend={'verl' if engine == 'verl' else 'nemo_rl'}" in args
    p = _translate(args)
    assert p.returncode == 0, p.stderr


def test_the_control_without_a_key_nemo_rl_needs_is_refused():
    args = next(a for n, e, a in COMMANDS if e == "NeMo-RL" and n == "qwen3-1.7b-dapo17k")
    p = _translate([a for a in args if a != "eval.samples=1"])
    assert p.returncode != 0 and "eval.samples" in p.stderr, p.stderr
