"""Untrusted side of the code sandbox (stdlib only): runs a program on each test input.

Started by _sandbox_launch.py as `python -I -S runner.py` inside the sandbox's private work
directory, as the throw-away sandbox uid, with payload.json beside it:
    {"mode": "stdio" | "call", "program": str, "inputs": [str, ...], "func_name": str | None,
     "timeout_s": float, "max_output_bytes": int, "block_sockets": bool, "header": str}
It first writes {"ready": true} (before any model code runs), then for every input one JSON
line to stdout:
    {"i": 0, "status": "ok" | "timeout" | "error", "stdout": "..."}     (stdio mode)
    {"i": 0, "status": "ok" | "timeout" | "error", "result": "<json>"}  (call mode)
and stops at the first test that does not end "ok" (that test already fails the program).
Everything here runs next to the untrusted code and can be subverted by it; that is why it only
reports raw outputs and never sees the expected ones.
"""

import json
import os
import signal
import subprocess
import sys

# Installed in every process that runs model code when the kernel gave us no network
# namespace: refuse to create sockets at all (audit hooks cannot be removed once added).
SOCKET_GUARD = """
import sys as _sys
def _mba_no_net(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in the sandbox")
_sys.addaudithook(_mba_no_net)
del _sys, _mba_no_net
"""

STDIO_BOOT = """
{guard}
_src = open("prog.py").read()
exec(compile(_src, "prog.py", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


class _Timeout(BaseException):
    """BaseException so that a bare `except Exception` in model code does not swallow it."""


def _on_alarm(signum, frame):
    raise _Timeout


def _emit(out_fd: int, record: dict) -> None:
    os.write(out_fd, (json.dumps(record) + "\n").encode())


def _cap_child(max_output_bytes: int, cpu_s: int):
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_output_bytes, max_output_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))

    return limit


def run_stdio(p: dict, out_fd: int) -> None:
    with open("prog.py", "w") as f:
        f.write(p["program"])
    with open("boot.py", "w") as f:
        f.write(STDIO_BOOT.format(guard=SOCKET_GUARD if p["block_sockets"] else ""))
    cpu_s = int(p["timeout_s"]) + 1
    for i, text in enumerate(p["inputs"]):
        with open("in.txt", "w") as f:
            f.write(text)
        with open("in.txt", "rb") as f_in, open("out.txt", "wb") as f_out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "boot.py"],
                stdin=f_in,
                stdout=f_out,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_cap_child(p["max_output_bytes"], cpu_s),
            )
            try:
                rc = proc.wait(timeout=p["timeout_s"])
                status = "ok" if rc == 0 else "error"
            except subprocess.TimeoutExpired:
                status = "timeout"
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
        with open("out.txt", "rb") as f:
            data = f.read(p["max_output_bytes"])
        _emit(out_fd, {"i": i, "status": status, "stdout": data.decode("utf-8", "replace")})
        if status != "ok":
            return


def run_call(p: dict, out_fd: int) -> None:
    if p["block_sockets"]:
        exec(SOCKET_GUARD, {})
    sys.stdout = open(os.devnull, "w")  # prints of the model's code must not reach the results
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGALRM, _on_alarm)
    namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        signal.setitimer(signal.ITIMER_REAL, p["timeout_s"])
        exec(compile(p["header"] + p["program"], "prog.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        name = p["func_name"]
        if "Solution" in namespace:
            fn = getattr(namespace["Solution"](), name)
        else:
            fn = namespace[name]
    except BaseException as exc:  # any failure to load fails every test
        signal.setitimer(signal.ITIMER_REAL, 0)
        status = "timeout" if isinstance(exc, _Timeout) else "error"
        _emit(out_fd, {"i": 0, "status": status, "result": None, "detail": repr(exc)[:200]})
        return
    for i, text in enumerate(p["inputs"]):
        try:
            args = [json.loads(line) for line in text.split("\n") if line.strip()]
            signal.setitimer(signal.ITIMER_REAL, p["timeout_s"])
            value = fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            record = {"i": i, "status": "ok", "result": json.dumps(value)}
        except BaseException as exc:
            signal.setitimer(signal.ITIMER_REAL, 0)
            status = "timeout" if isinstance(exc, _Timeout) else "error"
            record = {"i": i, "status": status, "result": None, "detail": repr(exc)[:200]}
        _emit(out_fd, record)
        if record["status"] != "ok":
            return


def main() -> int:
    with open("payload.json") as f:
        payload = json.load(f)
    out_fd = os.dup(1)  # the result channel; fd 1 itself goes to /dev/null for model code
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    # Before any model code runs: the caller tells "the runner never started" (a broken
    # interpreter, a failed set-up: an error) from "the program failed" (a score of 0).
    _emit(out_fd, {"ready": True})
    if payload["mode"] == "stdio":
        run_stdio(payload, out_fd)
    else:
        run_call(payload, out_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
