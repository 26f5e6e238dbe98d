"""Math reward that never hangs and never fails silently: scoring workers under a hard limit.

    from megatron_ba.rewards import MathRewardPool
    with MathRewardPool(workers=2, timeout_s=5.0) as pool:
        out = pool.score(responses, ground_truths)
    out.scores        # [1.0, 0.0, ...] in input order
    out.metrics       # {"math_reward/timeouts": 0, "math_reward/timeout_share": 0.0, ...}

Why processes: math-verify's own timeout is SIGALRM (main thread only) and sympy can spin inside
C code (huge integer powers) where no signal is ever handled. So each answer goes to a worker
that gets exactly one answer at a time; when it overruns `timeout_s` the worker is SIGKILLed, the
answer scores 0.0 and is counted as a timeout, and a fresh worker takes its place.

Why a server of our own and not multiprocessing: multiprocessing's spawn and forkserver start
methods run the caller's `__main__` again in every child (as `__mp_main__`), so a script without
an `if __name__ == "__main__":` guard recursed into the pool, and `python -` (a `__main__` read
from stdin, `/tmp/<stdin>`) could not be re-imported at all: the workers died at start-up and,
before this module was rewritten, every answer scored 0.0. Forking the caller instead is unsafe
in a threaded trainer (CUDA, vLLM). So the pool starts one server process with
`subprocess` (`_math_server.py`, run as a program with the caller's sys.path and nothing of its
`__main__`), which preloads math-verify and forks the workers from itself: a worker is ready in
milliseconds, and scoring works the same from an unguarded script, `python -` or a REPL.

What is an answer's fault and what is not: a wrong answer scores 0.0; an answer that overruns the
hard limit scores 0.0 and is counted (`math_reward/timeouts`). Everything else is a failure of
the scoring machinery and raises `MathRewardError` naming the cause, never a score: the server or
a worker failing to start (e.g. math-verify not importable), a worker dying by anything but the
pool's own timeout kill (OOM killer, a crash), the server dying, a malformed message, an exception
inside the judgement code. After such an error the pool stops its processes and starts afresh on
the next call.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

SERVER_SCRIPT = Path(__file__).with_name("_math_server.py")
REPLY_TIMEOUT_S = 30.0  # a control reply is a fork or a reap: milliseconds, unless the box is dying


class MathRewardError(RuntimeError):
    """The math scoring machinery failed (not the answer): raised instead of scoring 0.0."""


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class _Server:
    """The `_math_server.py` process and its control channel (see that module's docstring)."""

    def __init__(self, soft_timeout_s: int | None, start_timeout_s: float) -> None:
        if not sys.executable:
            raise MathRewardError("math reward server: sys.executable is empty, no Python to run")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        paths = [p or os.getcwd() for p in sys.path]  # "" is the caller's cwd
        cmd = [sys.executable, "-I", str(SERVER_SCRIPT), str(theirs.fileno())]
        cmd += ["none" if soft_timeout_s is None else str(soft_timeout_s), json.dumps(paths)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            msg = f"math reward server could not be started ({cmd[0]}): {exc}"
            raise MathRewardError(msg) from exc
        finally:
            theirs.close()
        self.ctrl = ours
        reply = self._recv(start_timeout_s, "start-up")
        if reply.startswith(b"error "):
            self.close()
            detail = reply[6:].decode(errors="replace").rstrip()
            raise MathRewardError(f"math reward server failed to start:\n{detail}")
        if reply != b"ready":
            self.close()
            raise MathRewardError(f"math reward server: protocol error at start-up: {reply[:80]!r}")

    def _death(self, during: str) -> str:
        try:
            rc = self.proc.wait(timeout=5)
            how = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
        except subprocess.TimeoutExpired:
            how = "still running but its channel is closed"
        return f"math reward server (pid {self.proc.pid}) died during {during} ({how})"

    def _recv(self, timeout: float, during: str) -> bytes:
        self.ctrl.settimeout(timeout)
        try:
            msg = self.ctrl.recv(65536)
        except TimeoutError:
            raise MathRewardError(
                f"math reward server (pid {self.proc.pid}) gave no reply during {during} "
                f"within {timeout:g} s"
            ) from None
        except OSError:
            msg = b""
        if not msg:
            raise MathRewardError(self._death(during))
        return msg

    def _request(self, data: bytes, during: str, fds: tuple[int, ...] = ()) -> bytes:
        try:
            socket.send_fds(self.ctrl, [data], list(fds))
        except OSError:
            raise MathRewardError(self._death(during)) from None
        reply = self._recv(REPLY_TIMEOUT_S, during)
        if reply.startswith(b"error "):
            raise MathRewardError(f"math reward server refused {data[:40]!r}: {reply[6:80]!r}")
        return reply

    def spawn(self) -> tuple[int, Connection]:
        ours, theirs = socket.socketpair()
        try:
            reply = self._request(b"spawn", "a worker's start", (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        word, _, pid = reply.partition(b" ")
        if word != b"pid" or not pid.isdigit():
            ours.close()
            raise MathRewardError(f"math reward server: protocol error on spawn: {reply[:80]!r}")
        return int(pid), Connection(ours.detach())

    def reap(self, pid: int) -> tuple[float, str]:
        """SIGKILL (if still running) and reap a worker: (its CPU seconds, how it ended)."""
        reply = self._request(b"kill %d" % pid, f"the reaping of worker {pid}")
        parts = reply.split(b" ")
        if len(parts) != 3 or parts[0] != b"dead":
            raise MathRewardError(f"math reward server: protocol error on kill: {reply[:80]!r}")
        return float(parts[1]), parts[2].decode().replace("-", " ")

    def close(self) -> None:
        self.ctrl.close()  # the server kills and reaps its workers, then exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Worker:
    def __init__(self, server: _Server, start_timeout_s: float) -> None:
        self.pid, self.conn = server.spawn()
        self.task: int | None = None
        self.deadline = 0.0
        self.sent = 0.0
        if not self.conn.poll(start_timeout_s):
            raise MathRewardError(
                f"math reward worker (pid {self.pid}) sent no greeting within {start_timeout_s:g} s"
            )
        try:
            hello = json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            _, how = server.reap(self.pid)
            msg = f"math reward worker (pid {self.pid}) died at start-up ({how})"
            raise MathRewardError(msg) from None
        if hello != ["ready", self.pid]:
            raise MathRewardError(f"math reward worker: protocol error at start-up: {hello!r:.80}")


@dataclass
class MathScores:
    scores: list[float]
    timed_out: list[bool]
    metrics: dict = field(default_factory=dict)


class MathRewardPool:
    """A pool of scoring processes; `score` is thread-safe (calls are serialised).

    workers: processes (default: one per core); timeout_s: the hard wall-clock limit per answer;
    start_timeout_s: how long the server may take to start (it imports math-verify and sympy).
    """

    def __init__(
        self, workers: int | None = None, timeout_s: float = 5.0, start_timeout_s: float = 120.0
    ) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.n_workers = workers or os.cpu_count() or 1
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        # math-verify's own SIGALRM limit ends most slow cases gracefully, before the hard kill.
        self._soft = max(1, int(self.timeout_s / 2)) if self.timeout_s >= 2 else None
        self._server: _Server | None = None
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.totals = {"pairs": 0, "timeouts": 0, "restarts": 0, "seconds": 0.0}
        self._killed_cpu = 0.0

    def _ensure_workers(self) -> None:
        if self._server is None:
            self._server = _Server(self._soft, self.start_timeout_s)
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._server, REPLY_TIMEOUT_S))

    def score(self, responses: list[str], ground_truths: list[str]) -> MathScores:
        if len(responses) != len(ground_truths):
            raise ValueError(
                f"responses and ground_truths differ in length: "
                f"{len(responses)} vs {len(ground_truths)}"
            )
        for name, seq in (("responses", responses), ("ground_truths", ground_truths)):
            for i, x in enumerate(seq):
                if not isinstance(x, str):
                    raise ValueError(f"{name}[{i}] must be a str, got {type(x).__name__}")
        with self._lock:
            try:
                return self._score(list(responses), list(ground_truths))
            except BaseException:  # machinery error or Ctrl-C: no half-finished state survives
                self._stop_processes()
                raise

    def _score(self, responses: list[str], truths: list[str]) -> MathScores:
        n = len(responses)
        scores = [0.0] * n
        timed_out = [False] * n
        started = time.monotonic()
        restarts = 0
        busy_time = 0.0  # seconds some worker held an answer: the pool's own idleness shows here
        if n:
            self._ensure_workers()
        pending = iter(range(n))
        remaining = n
        idle = list(self._workers)
        busy: dict = {}  # conn -> worker
        while remaining:
            while idle:
                idx = next(pending, None)
                if idx is None:
                    break
                w = idle.pop()
                try:
                    w.conn.send_bytes(json.dumps([idx, responses[idx], truths[idx]]).encode())
                except OSError:
                    self._worker_failed(w, "while idle")
                w.sent = time.monotonic()
                w.task, w.deadline = idx, w.sent + self.timeout_s
                busy[w.conn] = w
            now = time.monotonic()
            nearest = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, nearest - now)):
                w = busy.pop(conn)
                busy_time += time.monotonic() - w.sent
                try:
                    reply = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._worker_failed(w, f"while scoring response {w.task}")
                scores[w.task] = self._check_reply(reply, w)
                w.task = None
                remaining -= 1
                idle.append(w)
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now >= w.deadline:  # hard limit: kill, score 0, count, replace
                    busy.pop(conn)
                    busy_time += now - w.sent
                    timed_out[w.task] = True
                    scores[w.task] = 0.0
                    remaining -= 1
                    idle.append(self._replace(w))
                    restarts += 1
        elapsed = time.monotonic() - started
        n_to = sum(timed_out)
        for key, value in (("pairs", n), ("timeouts", n_to), ("restarts", restarts)):
            self.totals[key] += value
        self.totals["seconds"] += elapsed
        metrics = {
            "math_reward/pairs": n,
            "math_reward/timeouts": n_to,
            "math_reward/timeout_share": n_to / n if n else 0.0,
            "math_reward/seconds": elapsed,
            "math_reward/pairs_per_s": n / elapsed if elapsed > 0 else 0.0,
            "math_reward/worker_busy_share": (
                busy_time / (elapsed * self.n_workers) if elapsed > 0 else 0.0
            ),
        }
        return MathScores(scores, timed_out, metrics)

    @staticmethod
    def _check_reply(reply, w: _Worker) -> float:
        if isinstance(reply, list) and len(reply) == 3 and reply[0] == w.task:
            raise MathRewardError(f"scoring response {w.task} raised in the worker:\n{reply[2]}")
        if not (isinstance(reply, list) and len(reply) == 2 and reply[0] == w.task):
            raise MathRewardError(
                f"math reward worker (pid {w.pid}): protocol error, expected a reply for "
                f"response {w.task}, got {reply!r:.80}"
            )
        if reply[1] not in (0.0, 1.0):
            raise MathRewardError(f"math reward worker (pid {w.pid}): score {reply[1]!r}")
        return float(reply[1])

    def _worker_failed(self, w: _Worker, when: str):
        """A worker died by something other than our timeout kill: raise, naming how."""
        _, how = self._server.reap(w.pid)  # raises instead if the server itself is gone
        raise MathRewardError(
            f"math reward worker (pid {w.pid}) died {when} ({how}); no score was given. "
            "The pool restarts its processes on the next call."
        )

    def worker_cpu_seconds(self) -> float:
        """CPU seconds used by all workers so far, the replaced ones included (Linux)."""
        return self._killed_cpu + sum(process_cpu_seconds(w.pid) for w in self._workers)

    def _replace(self, w: _Worker) -> _Worker:
        w.conn.close()
        cpu, _ = self._server.reap(w.pid)
        self._killed_cpu += cpu
        fresh = _Worker(self._server, REPLY_TIMEOUT_S)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _stop_processes(self) -> None:
        for w in self._workers:
            w.conn.close()
        self._workers = []
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def close(self) -> None:
        with self._lock:
            self._stop_processes()

    def __enter__(self) -> MathRewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DEFAULT: MathRewardPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> MathRewardPool:
    """The process-wide pool behind math_score / math_score_batch (one worker per core)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathRewardPool()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def math_score_batch(
    responses: list[str],
    ground_truths: list[str],
    *,
    timeout_s: float | None = None,
    pool: MathRewardPool | None = None,
) -> list[float]:
    """Scores (1.0 / 0.0) of many pairs, in order, through `pool` (default: the shared pool).

    `timeout_s` builds a dedicated pool with that hard per-answer limit for this call.
    """
    if timeout_s is not None and pool is None:
        with MathRewardPool(timeout_s=timeout_s) as own:
            return own.score(responses, ground_truths).scores
    return (pool or default_pool()).score(responses, ground_truths).scores


def math_score(response: str, ground_truth: str) -> float:
    """1.0 if the final answer of `response` equals `ground_truth`, else 0.0.

    Never hangs: scored in the shared worker pool under a hard wall-clock limit (a timeout
    scores 0.0 and is counted in `default_pool().totals`); a failure of the scoring machinery
    raises MathRewardError.
    """
    return default_pool().score([response], [ground_truth]).scores[0]
