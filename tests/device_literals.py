"""Literal devices in source code, found statically (tests/test_devices_literals.py uses it).

Devices are parameters: a rank's device is `DistContext.device` (parallel/world.py chooses
it) or its input tensors' device. What counts as a literal device:
  * `x.cuda(...)` (a tensor or module sent to "the" GPU, cuda:0 on every rank);
  * `torch.device("...")` with a string constant;
  * a keyword `device="..."` with a string constant (`device="cpu"`, `device="cuda:1"`);
  * `x.to("...")` with a string constant naming a device.
Not counted: `.cpu()` (a host copy for saving, pickling, logging), `device.type == "cuda"`
(asking what a device is), and strings in comments and docstrings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

DEVICE_STRING = re.compile(r"^(cpu|cuda|meta|mps)(:\d+)?$")
# Files that may name a device, and why.
ALLOWED = {
    # The device module: chooses each rank's device.
    "megatron_ba/parallel/world.py": "chooses DistContext.device",
    # The CPU shims exist to reroute megatron-core's "cuda" allocations to the CPU.
    "megatron_ba/megatron/cpu_compat.py": "CPU-only shims",
    # comm_device: where a collective's tensors must be, by the group's backend (NCCL: the
    # current CUDA device, which parallel.world.join_world made this rank's; gloo: the CPU).
    "megatron_ba/parallel/collectives.py": "the backend's device",
    # Runs inside NeMo-Aligner's worker, where NeMo has set each rank's current CUDA device and
    # its own code moves batches with .cuda(); not part of the local backend.
    "megatron_ba/integrations/nemo_aligner/actor.py": "NeMo-Aligner's convention",
}


def _is_device_string(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and bool(DEVICE_STRING.match(node.value))
    )


def literal_devices(source: str) -> list[tuple[int, str]]:
    """(line, what) of every literal device in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "cuda":
            found.append((node.lineno, ".cuda()"))
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "device"
            and isinstance(f.value, ast.Name)
            and f.value.id == "torch"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((node.lineno, f"torch.device({node.args[0].value!r})"))
        for kw in node.keywords:
            if kw.arg == "device" and _is_device_string(kw.value):
                found.append((node.lineno, f"device={kw.value.value!r}"))
        if isinstance(f, ast.Attribute) and f.attr == "to":
            for a in node.args:
                if _is_device_string(a):
                    found.append((node.lineno, f".to({a.value!r})"))
    return found


def violations(root: Path, folders=("megatron_ba",)) -> list[str]:
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in ALLOWED:
                continue
            for line, what in literal_devices(path.read_text()):
                out.append(f"{rel}:{line}: {what}")
    return out
