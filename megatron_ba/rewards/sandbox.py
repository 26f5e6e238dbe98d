"""Run untrusted model-written Python on test inputs, contained (caller side of the sandbox).

    from megatron_ba.rewards.sandbox import SandboxLimits, run_program
    run = run_program("print(int(input()) * 2)", ["21\\n"], mode="stdio")
    run.outputs   # [TestOutput(status='ok', stdout='42\\n', result=None)]

Layers (each recorded in `SandboxRun.isolation`; see docs/data-and-rewards.md):
- a separate process tree started through a fresh trusted launcher (_sandbox_launch.py);
- a throw-away uid per run when we are root, so RLIMIT_NPROC bites (root ignores it), other
  users' files and /proc/PID/environ are out of reach, and kill(-1) only hits the sandbox;
- cgroups (v1 or v2) capping the number of tasks and the memory of the whole tree, when writable;
- rlimits on CPU time, address space, file size, processes, open files, core dumps;
- a new network namespace (no usable interface) or, if the kernel refuses, an audit hook
  refusing every socket operation;
- a new mount namespace: size-limited private tmpfs scratch space, the rest read-only;
- a wall-clock limit enforced twice (launcher, then this process), output caps, scrubbed env.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
LAUNCHER = _HERE / "_sandbox_launch.py"
RUNNER = _HERE / "_sandbox_runner.py"
UID_RANGE = (2_000_000, 2_999_999)  # far from distribution and subuid ranges
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "megatron_ba_sandbox"

# Names that LiveCodeBench-style call-based solutions use without importing them.
CALL_HEADER = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\n"
    "from functools import *\nfrom heapq import *\nfrom bisect import *\nfrom math import *\n"
    "import math, sys, re, string, heapq, bisect, itertools, functools, collections\n"
)


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `timeout_s` is per test; the whole run gets `wall_s`."""

    timeout_s: float = 6.0
    address_space_bytes: int = 1 << 30  # per process (RLIMIT_AS)
    memory_bytes: int = 2 << 30  # whole process tree (cgroup)
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: any file, including the result channel
    max_output_bytes: int = 16 << 20  # a test's stdout
    processes: int = 32  # RLIMIT_NPROC of the sandbox uid, and the cgroup's pids.max
    open_files: int = 256
    tmpfs_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "address_space_bytes", "memory_bytes", "file_size_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.processes < 4:
            raise ValueError(f"SandboxLimits.processes must be >= 4, got {self.processes}")


@dataclass(frozen=True)
class TestOutput:
    status: str  # "ok" | "timeout" | "error" | "not_run"
    stdout: str | None = None  # stdio mode
    result: str | None = None  # call mode: the JSON text of the return value


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): nothing was scored."""


@dataclass
class SandboxRun:
    outputs: list[TestOutput]
    status: str  # "exited" | "timeout" | "error"
    isolation: dict = field(default_factory=dict)
    elapsed_s: float = 0.0


def _reachable_by_others(path: str) -> bool:
    p = Path(path).resolve()
    for part in [p, *p.parents]:
        mode = part.stat().st_mode
        if part != p and not mode & 0o001:
            return False
    return bool(p.stat().st_mode & 0o001)


def _fallback_python() -> str:
    if _reachable_by_others(sys.executable):
        return sys.executable
    return shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def _pick_uid() -> int:
    in_use = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                in_use.add(entry.stat().st_uid)
            except OSError:
                pass
    while True:
        uid = random.randint(*UID_RANGE)
        if uid not in in_use:
            return uid


class _Cgroups:
    """Per-run cgroups capping tasks and memory (v1 hierarchies or v2), best effort."""

    def __init__(self, name: str, limits: SandboxLimits) -> None:
        self.dirs: list[Path] = []
        v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        try:
            if v2:
                parent = CGROUP_ROOT / CGROUP_PARENT
                parent.mkdir(exist_ok=True)
                (CGROUP_ROOT / "cgroup.subtree_control").write_text("+pids +memory")
                (parent / "cgroup.subtree_control").write_text("+pids +memory")
                d = parent / name
                d.mkdir()
                self.dirs.append(d)
                (d / "pids.max").write_text(str(limits.processes))
                (d / "memory.max").write_text(str(limits.memory_bytes))
                (d / "memory.swap.max").write_text("0")
            else:
                for ctrl, files in (
                    ("pids", {"pids.max": limits.processes}),
                    ("memory", {"memory.limit_in_bytes": limits.memory_bytes}),
                ):
                    d = CGROUP_ROOT / ctrl / CGROUP_PARENT / name
                    d.mkdir(parents=True)
                    self.dirs.append(d)
                    for fname, value in files.items():
                        (d / fname).write_text(str(value))
        except OSError:
            self.remove()

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def kill_all(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(100):  # rmdir fails (EBUSY) until the killed tasks are gone
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = []


def run_program(
    program: str,
    inputs: list[str],
    *,
    mode: str = "stdio",
    func_name: str | None = None,
    limits: SandboxLimits | None = None,
    wall_s: float | None = None,
    namespaces: bool = True,
) -> SandboxRun:
    """Run `program` on each of `inputs` in a fresh sandbox; return the raw outputs.

    mode "stdio": each input is fed on stdin to a fresh interpreter, stdout is captured.
    mode "call": the program is loaded once and `func_name` (a function, or a method of class
    `Solution`) is called with the JSON values on each input's lines as arguments.
    Tests after the first one that errors or times out are reported as "not_run".
    namespaces=False skips the network and mount namespaces (the fallbacks a kernel without
    them gets: sockets refused by an audit hook, a private work folder under /tmp).
    """
    if mode not in ("stdio", "call"):
        raise ValueError(f"mode must be 'stdio' or 'call', got {mode!r}")
    if mode == "call" and not func_name:
        raise ValueError("func_name is required for call-based tests (mode='call')")
    if not isinstance(program, str):
        raise ValueError(f"program must be a str, got {type(program).__name__}")
    limits = limits or SandboxLimits()
    wall_s = wall_s if wall_s is not None else limits.timeout_s * (len(inputs) + 1) + 5.0
    is_root = os.geteuid() == 0
    uid = _pick_uid() if is_root else None
    private = Path(tempfile.mkdtemp(prefix="mba-sbx-"))  # 0700, ours: the sandbox cannot read it
    fallback_work = Path(tempfile.mkdtemp(prefix="mba-sbx-work-"))
    cgroups = _Cgroups(f"run-{uuid.uuid4().hex[:12]}", limits) if is_root else None
    try:
        payload = {
            "mode": mode,
            "program": program,
            "inputs": list(inputs),
            "func_name": func_name,
            "timeout_s": float(limits.timeout_s),
            "max_output_bytes": int(limits.max_output_bytes),
            "block_sockets": False,
            "header": CALL_HEADER,
        }
        base_python = _base_interpreter()
        config = {
            "uid": uid,
            "namespaces": bool(namespaces),
            "cgroup_procs": cgroups.procs_files if cgroups else [],
            "wall_s": wall_s,
            "limits": {
                "cpu_s": int(wall_s) + 1,
                "address_space": int(limits.address_space_bytes),
                "file_size": int(limits.file_size_bytes),
                "processes": int(limits.processes),
                "open_files": int(limits.open_files),
            },
            "tmpfs_bytes": int(limits.tmpfs_bytes),
            "python_prefix": sys.base_prefix,
            "python_rel": str(base_python.relative_to(sys.base_prefix)) if base_python else "",
            "python_libdir_rel": _libdir_under_base_prefix(),
            "python_fallback": _fallback_python(),
            "fallback_workdir": str(fallback_work),
            "runner_src": str(RUNNER),
            "payload": str(private / "payload.json"),
        }
        (private / "payload.json").write_text(json.dumps(payload))
        (private / "config.json").write_text(json.dumps(config))
        return _launch(private, config, len(inputs), cgroups, limits)
    finally:
        if cgroups:
            cgroups.kill_all()
            cgroups.remove()
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(fallback_work, ignore_errors=True)


def _libdir_under_base_prefix() -> str:
    """Where the interpreter's shared libpython lives, relative to sys.base_prefix ("" when it
    is elsewhere or static): the launcher points the bound interpreter's loader there."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return ""
    try:
        rel = Path(os.path.realpath(libdir)).relative_to(os.path.realpath(sys.base_prefix))
    except ValueError:
        return ""
    return str(rel)


def _base_interpreter() -> Path | None:
    """The real interpreter binary under sys.base_prefix (a venv's python is a symlink to it)."""
    real = Path(os.path.realpath(sys.executable))
    try:
        real.relative_to(os.path.realpath(sys.base_prefix))
    except ValueError:
        return None
    return Path(sys.base_prefix) / real.relative_to(os.path.realpath(sys.base_prefix))


def _launch(private: Path, config: dict, n_inputs: int, cgroups, limits) -> SandboxRun:
    result_path, status_path = private / "results.jsonl", private / "status.json"
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    started = time.monotonic()
    with open(result_path, "wb") as res, open(status_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER), "run", str(private / "config.json")],
            stdin=subprocess.DEVNULL,
            stdout=res,
            stderr=err,
            env=env,
            cwd="/",
            close_fds=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=config["wall_s"] + 10.0)
        except subprocess.TimeoutExpired:  # the trusted launcher itself is stuck: kill all
            proc.kill()
            proc.wait()
            if config["uid"] is not None:
                subprocess.run(
                    [sys.executable, "-I", "-S", str(LAUNCHER), "reap", str(config["uid"])],
                    env=env,
                    check=False,
                )
    elapsed = time.monotonic() - started
    status_lines = status_path.read_text(errors="replace").strip().splitlines()
    try:
        status = json.loads(status_lines[-1]) if status_lines else {}
    except json.JSONDecodeError:
        status = {}
    status.setdefault("status", "error")
    if status_lines and not status_lines[-1].startswith("{"):
        status["detail"] = status_lines[-1][:500]
    outputs, ready = _read_outputs(result_path, n_inputs, limits)
    if not ready:
        raise SandboxError(
            f"the sandbox's runner never started (launcher status {status}): no program was "
            "run, so no score can be given; the interpreter or the sandbox set-up is broken"
        )
    return SandboxRun(outputs, status.pop("status"), status, elapsed)


def _read_outputs(
    path: Path, n_inputs: int, limits: SandboxLimits
) -> tuple[list[TestOutput], bool]:
    """The per-input outputs, and whether the runner's first line was its ready handshake."""
    outputs: dict[int, TestOutput] = {}
    with open(path, "rb") as f:
        data = f.read(limits.file_size_bytes)
    lines = data.splitlines()
    try:
        ready = json.loads(lines[0]) == {"ready": True} if lines else False
    except ValueError:
        ready = False
    for line in lines[1:] if ready else lines:
        try:
            rec = json.loads(line)
            i = int(rec["i"])
            status = str(rec["status"])
        except (ValueError, KeyError, TypeError):
            continue  # model code scribbled on the channel: ignore what does not parse
        if 0 <= i < n_inputs and i not in outputs:
            out = rec.get("stdout")
            res = rec.get("result")
            outputs[i] = TestOutput(
                status,
                out if isinstance(out, str) else None,
                res if isinstance(res, str) else None,
            )
    return [outputs.get(i, TestOutput("not_run")) for i in range(n_inputs)], ready
