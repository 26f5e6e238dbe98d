"""The code sandbox against real attacks: each must be contained and scored as failed.

Every attack is checked twice: the program's score is 0.0, and the effect it aimed for did not
happen on this machine (no process left behind, no file written, no connection made, no secret
read, the scoring process alive). A benign program passing first shows the failures are the
sandbox's doing, not a broken harness.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import data_helpers  # noqa: F401
import pytest

from megatron_ba.rewards import SandboxLimits, code_score, run_program
from megatron_ba.rewards.sandbox import UID_RANGE

IS_ROOT = os.geteuid() == 0


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def stdin_test(expected: str, given: str = "") -> list[dict]:
    return [{"input": given, "output": expected, "testtype": "stdin"}]


def sandbox_processes() -> list[int]:
    """Live (non-zombie) processes owned by a sandbox uid."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
            with open(f"/proc/{entry.name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if UID_RANGE[0] <= uid <= UID_RANGE[1] and state != "Z":
            pids.append(int(entry.name))
    return pids


def unsandboxed(program: str, stdin: str, **env) -> str:
    """The attack run as a plain subprocess: shows it does work where nothing contains it."""
    out = subprocess.run(
        [sys.executable, "-c", program],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    return out.stdout


def count_processes() -> int:
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit())


def test_benign_program_passes_and_isolation_is_reported():
    assert code_score(fenced("print(input()[::-1])"), stdin_test("cba", "abc\n")) == 1.0
    run = run_program("print('hi')", [""])
    assert run.outputs[0].stdout == "hi\n"
    if IS_ROOT:
        assert run.isolation["net_isolated"] and run.isolation["fs_isolated"]
        assert UID_RANGE[0] <= run.isolation["uid"] <= UID_RANGE[1]
        assert run.isolation["cgroups"] >= 1 or not os.path.isdir("/sys/fs/cgroup/pids")


def test_fork_bomb_is_bounded_and_cleaned_up():
    bomb = (
        "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
        "    except OSError:\n        pass\n"
    )
    limits = SandboxLimits(timeout_s=2.0, processes=16)
    base, peak, stop = count_processes(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], count_processes())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = run_program(bomb, [""], limits=limits, wall_s=5.0)
    finally:
        stop.set()
        watcher.join()
    assert run.outputs[0].status == "timeout"
    # launcher + runner + at most `processes` sandbox tasks (+ slack for unrelated processes)
    assert peak[0] - base <= limits.processes + 8
    assert sandbox_processes() == []
    assert code_score(fenced(bomb), stdin_test("x"), timeout_s=1.0) == 0.0
    assert sandbox_processes() == []


def test_memory_bomb_fails():
    grow = "a = []\nwhile True:\n    a.append(bytearray(10**7))\n"
    assert code_score(fenced(grow), stdin_test("x")) == 0.0
    forked = (
        "import os\nfor _ in range(6):\n    if os.fork() == 0:\n        a = []\n"
        "        while True:\n            a.append(bytearray(10**7))\nos.wait()\nprint('x')\n"
    )
    limits = SandboxLimits(timeout_s=4.0, memory_bytes=512 << 20)
    run = run_program(forked, [""], limits=limits)
    assert run.status == "exited"
    assert sandbox_processes() == []


def test_infinite_loop_is_stopped():
    started = time.monotonic()
    assert code_score(fenced("while True:\n    pass"), stdin_test("x"), timeout_s=1.0) == 0.0
    assert time.monotonic() - started < 20
    call = [{"input": "1", "output": "1", "testtype": "functional"}]
    # swallows the runner's per-test alarm too: only the launcher's wall clock can stop it
    spin = "def f(x):\n    while True:\n        try:\n            pass\n"
    spin += "        except BaseException:\n            pass"
    assert code_score(fenced(spin), call, func_name="f", timeout_s=1.0) == 0.0


def test_writing_outside_its_directory_fails(tmp_path):
    target = tmp_path / "pwned.txt"
    attack = "path = input().strip()\nopen(path, 'w').write('pwned')\nprint('written')"
    control = tmp_path / "control.txt"
    assert unsandboxed(attack, f"{control}\n") == "written\n" and control.exists()
    for path in (target, "/etc/mba_pwned", os.path.join(os.getcwd(), "mba_pwned")):
        assert code_score(fenced(attack), stdin_test("written", f"{path}\n")) == 0.0
        assert not os.path.exists(path)
    # its own scratch space works, and what it leaves in /tmp never reaches this machine's /tmp
    marker = f"/tmp/mba_sandbox_marker_{os.getpid()}"
    run = run_program(attack, [f"{marker}\n", "./local.txt\n"])
    assert [o.stdout for o in run.outputs] == ["written\n", "written\n"]
    if IS_ROOT:
        assert not os.path.exists(marker)


def test_sockets_reach_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    attack = (
        "import socket\ns = socket.create_connection(('127.0.0.1', int(input())), timeout=2)\n"
        "s.sendall(b'pwned')\nprint('connected')"
    )
    try:
        assert unsandboxed(attack, f"{port}\n") == "connected\n"  # the attack is real
        server.accept()[0].close()
        assert code_score(fenced(attack), stdin_test("connected", f"{port}\n")) == 0.0
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_parent_environment_is_invisible(monkeypatch):
    secret = f"mba-secret-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("MBA_TEST_SECRET", secret)
    attack = (
        "import os\nfound = [os.environ.get('MBA_TEST_SECRET', '')]\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n        found.append(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError:\n        pass\n"
        "print([x for x in '\\n'.join(found).replace('\\0', '\\n').split('\\n')"
        " if x.startswith('MBA_TEST_SECRET=')][0].split('=', 1)[1])\n"
    )
    assert unsandboxed(attack, "") == secret + "\n"  # the attack is real
    run = run_program(attack, [""])
    assert secret not in (run.outputs[0].stdout or "")
    assert code_score(fenced(attack), stdin_test(secret)) == 0.0
    env_dump = run_program("import os\nprint(sorted(os.environ))", [""]).outputs[0].stdout
    assert "MBA_TEST_SECRET" not in env_dump and "PATH" in env_dump


def test_killing_its_parents_fails(tmp_path):
    attack = (
        "import os, signal\nme = int(input())\n"
        "for pid in (os.getppid(), me, 1, -1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n        pass\n"
        "print('killed')\n"
    )
    hits = []
    old = signal.signal(signal.SIGTERM, lambda *a: hits.append(a))
    try:
        assert code_score(fenced(attack), stdin_test("killed", f"{os.getpid()}\n")) == 0.0
    finally:
        signal.signal(signal.SIGTERM, old)
    assert hits == []
    # this process (and the machinery) survived: the next sandbox works as before
    assert code_score(fenced("print(6 * 7)"), stdin_test("42")) == 1.0
    assert sandbox_processes() == []


def test_fallbacks_without_namespaces_still_contain(tmp_path):
    """Where the kernel gives no namespaces: sockets are refused by an audit hook, the work dir
    is a private folder, and the uid, rlimits and cgroups still bound a fork bomb."""
    run = run_program("import os\nprint(os.getcwd())", [""], namespaces=False)
    assert run.outputs[0].status == "ok" and run.outputs[0].stdout.startswith("/tmp/mba-sbx-work-")
    assert not run.isolation["net_isolated"] and not run.isolation["fs_isolated"]
    assert run.isolation["block_sockets"]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    attack = (
        "import socket\ns = socket.create_connection(('127.0.0.1', int(input())), timeout=2)\n"
        "print('connected')"
    )
    try:
        port = server.getsockname()[1]
        run = run_program(attack, [f"{port}\n"], namespaces=False)
        assert run.outputs[0].status == "error"
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    target = tmp_path / "pwned.txt"
    write = "open(input().strip(), 'w').write('x')\nprint('written')"
    assert run_program(write, [f"{target}\n"], namespaces=False).outputs[0].status == "error"
    assert not target.exists()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    limits = SandboxLimits(timeout_s=1.0, processes=8)
    assert run_program(bomb, [""], limits=limits, namespaces=False).outputs[0].status == "timeout"
    assert sandbox_processes() == []


def test_the_sandbox_runs_this_interpreter_with_its_own_libpython():
    """The bound interpreter loads its own shared libpython, not the system's (or none: an
    interpreter under /root built with --enable-shared exited 127 there, and every program,
    right or wrong, scored 0.0)."""
    run = run_program("import sys; print(sys.version)", [""])
    assert run.outputs[0].status == "ok", run
    assert run.outputs[0].stdout.strip() == sys.version


def test_a_runner_that_never_starts_is_an_error_not_a_zero(monkeypatch, tmp_path):
    """No ready handshake from the runner: the sandbox failed, so code_score raises rather
    than score the program 0.0. The control: the same call with the real runner scores 1.0."""
    from megatron_ba.rewards import sandbox

    tests = stdin_test("cba\n", "abc\n")
    assert code_score(fenced("print(input()[::-1])"), tests) == 1.0
    dead = tmp_path / "runner.py"
    dead.write_text("import sys\nsys.exit(127)\n")  # as an interpreter that cannot load
    monkeypatch.setattr(sandbox, "RUNNER", dead)
    with pytest.raises(sandbox.SandboxError, match="never started"):
        code_score(fenced("print(input()[::-1])"), tests)
