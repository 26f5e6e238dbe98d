"""The math reward's worker server: one process that forks the scoring workers (stdlib only).

Started by `math_pool.MathRewardPool` as

    python -I megatron_ba/rewards/_math_server.py CTRL_FD SOFT_TIMEOUT SYS_PATH_JSON

i.e. as a program of its own, never by re-importing the caller's `__main__` (what
multiprocessing's spawn/forkserver do, which breaks unguarded scripts and `python -`). It is run
by path, not `python -m megatron_ba...`, so that it does not import the `megatron_ba` package
(which imports torch): the server preloads only `math_answer.py` (loaded by path under a private
name), math-verify and sympy, and scores a few warm-up pairs, so that each worker forked from it
is ready, and fast, in milliseconds. `-I` keeps the script's folder off sys.path
(`rewards/code.py` would shadow the stdlib `code`); the caller's sys.path is passed in instead,
so packages resolve as in the caller.

Control channel (AF_UNIX SOCK_SEQPACKET, one message per request, replies in order):
  server -> caller  b"ready" once preloaded, or b"error " + traceback (then it exits)
  caller -> server  b"spawn" with one socket fd attached -> b"pid N": a worker forked onto it
  caller -> server  b"kill N" -> b"dead CPU_SECONDS STATUS": SIGKILL (harmless if it already
                    exited) and reap; CPU_SECONDS from the child's rusage
The server never reaps a worker on its own, so a pid the caller holds cannot be reused by an
unrelated process before the caller's `kill`. When the caller goes away (EOF on the control
channel) the server kills and reaps every worker and exits; workers die with the server
(PR_SET_PDEATHSIG), and exit on EOF from the caller.

Worker channel (a stream socket framed by multiprocessing.connection.Connection, JSON payloads):
  worker -> caller  ["ready", pid]
  caller -> worker  [idx, response, ground_truth]  ->  [idx, score] or [idx, null, traceback]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback

PR_SET_PDEATHSIG = 1
# Scored once in the server before it forks anything: math-verify and sympy build parsers and
# caches and import modules lazily (0.1-0.9 s per kind of answer in a fresh process; 7 s for a
# first equation under load 20), so every forked worker, the replacement of a killed one
# included, starts warm and its hard limit (or math-verify's soft one) is not spent on that.
WARM_UP = [
    ("Answer: \\frac{1}{2}", "0.5"),
    ("Answer: [1, 3)", "[1,3)"),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),
    ("Answer: x = 3", "3"),
    ("Answer: 2\\sqrt{2}", "\\sqrt{8}"),
    ("Answer: \\text{(B)}", "(B)"),
    ("Answer: (x+1)^2", "x^2+2x+1"),
    ("Answer: 2x + 1 = 0", "-2x - 1 = 0"),  # equations import more of sympy (0.9 s, 17 modules)
]


def _load_judge():
    """judge_math from math_answer.py beside this file, with math-verify and sympy imported."""
    import importlib.util
    import logging

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_answer.py")
    spec = importlib.util.spec_from_file_location("_megatron_ba_math_answer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import math_verify  # noqa: F401  (preloaded: every forked worker starts with it)
    import sympy  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # soft timeouts are expected
    for response, truth in WARM_UP:
        module.judge_math(response, truth, soft_timeout_s=None)
    return module.judge_math


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the server exits (Linux; the server is single-threaded, so the
    'parent thread' of PR_SET_PDEATHSIG is the server itself)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the server died before prctl took effect
        os._exit(1)


def _worker(fd: int, judge, soft_timeout_s: int | None) -> None:
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    conn.send_bytes(json.dumps(["ready", os.getpid()]).encode())
    while True:
        try:
            idx, response, truth = json.loads(conn.recv_bytes())
        except EOFError:  # the caller closed the channel: a graceful stop
            return
        try:
            reply = [idx, judge(response, truth, soft_timeout_s=soft_timeout_s)]
        except Exception:  # a bug in the judgement code: the caller raises it, never scores it
            reply = [idx, None, traceback.format_exc()[-2000:]]
        conn.send_bytes(json.dumps(reply).encode())


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed-by-{name}"
    return f"exit-{os.WEXITSTATUS(status)}"


def serve(ctrl: socket.socket, judge, soft_timeout_s: int | None) -> None:
    children: set[int] = set()
    me = os.getpid()
    try:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(ctrl, 256, 1)
            except (ConnectionError, OSError):
                return
            if not msg:  # the caller went away
                return
            cmd, _, arg = msg.partition(b" ")
            if cmd == b"spawn" and len(fds) == 1:
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        ctrl.close()
                        _die_with_parent(me)
                        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's
                        _worker(fds[0], judge, soft_timeout_s)
                    except BaseException:
                        code = 1
                    os._exit(code)
                os.close(fds[0])
                children.add(pid)
                ctrl.send(b"pid %d" % pid)
            elif cmd == b"kill" and arg.isdigit() and int(arg) in children:
                pid = int(arg)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status, usage = os.wait4(pid, 0)
                children.discard(pid)
                cpu = usage.ru_utime + usage.ru_stime
                ctrl.send(f"dead {cpu:.6f} {_describe(status)}".encode())
            else:
                for fd in fds:
                    os.close(fd)
                ctrl.send(b"error unknown request " + msg[:80])
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def main(argv: list[str]) -> int:
    ctrl_fd, soft, path_json = argv[1], argv[2], argv[3]
    sys.path[:] = json.loads(path_json)
    ctrl = socket.socket(fileno=int(ctrl_fd))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's; EOF stops the server
    try:
        judge = _load_judge()
    except BaseException:
        ctrl.send(b"error " + traceback.format_exc()[-3000:].encode())
        return 1
    ctrl.send(b"ready")
    serve(ctrl, judge, None if soft == "none" else int(soft))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
