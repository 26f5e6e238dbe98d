"""Math reward that never hangs: worker processes with a hard wall-clock limit per answer.

    from megatron_ba.rewards import MathRewardPool
    with MathRewardPool(workers=2, timeout_s=5.0) as pool:
        out = pool.score(responses, ground_truths)
    out.scores        # [1.0, 0.0, ...] in input order
    out.metrics       # {"math_reward/timeouts": 0, "math_reward/timeout_share": 0.0, ...}

Why processes: math-verify's own timeout is SIGALRM (main thread only) and sympy can spin inside
C code (huge integer powers) where no signal is ever handled. So each answer goes to a worker
that gets exactly one answer at a time; when it overruns `timeout_s` the worker is SIGKILLed, the
answer scores 0.0 and is counted as a timeout, and a fresh worker is forked from a forkserver
that has math-verify already imported (restart in milliseconds, not seconds).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

_PRELOAD = ["megatron_ba.rewards.math_answer", "math_verify", "sympy"]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _worker_main(conn, soft_timeout_s: int | None) -> None:
    import logging

    from megatron_ba.rewards.math_answer import judge_math

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # soft timeouts are expected

    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        idx, response, truth = task
        try:
            score = judge_math(response, truth, soft_timeout_s=soft_timeout_s)
            conn.send((idx, score, None))
        except Exception as exc:  # reported to the caller as an error (score 0)
            conn.send((idx, 0.0, repr(exc)[:200]))


@dataclass
class MathScores:
    scores: list[float]
    timed_out: list[bool]
    errors: list[str | None]
    metrics: dict = field(default_factory=dict)


class _Worker:
    def __init__(self, ctx, soft_timeout_s: int | None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, soft_timeout_s), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0
        self.sent = 0.0
        self.cpu_at_exit = 0.0

    def kill(self) -> None:
        self.cpu_at_exit = process_cpu_seconds(self.proc.pid)
        self.proc.kill()
        self.proc.join()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=2.0)
        if self.proc.is_alive():
            self.kill()
        else:
            self.conn.close()


class MathRewardPool:
    """A pool of scoring processes; `score` is thread-safe (calls are serialised)."""

    def __init__(self, workers: int | None = None, timeout_s: float = 5.0) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.n_workers = workers or os.cpu_count() or 1
        self.timeout_s = float(timeout_s)
        # math-verify's own SIGALRM limit ends most slow cases gracefully, before the hard kill.
        self._soft = max(1, int(self.timeout_s / 2)) if self.timeout_s >= 2 else None
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.totals = {"pairs": 0, "timeouts": 0, "errors": 0, "restarts": 0, "seconds": 0.0}
        self._killed_cpu = 0.0

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx, self._soft))

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
            return self._score(list(responses), list(ground_truths))

    def _score(self, responses: list[str], truths: list[str]) -> MathScores:
        n = len(responses)
        scores = [0.0] * n
        timed_out = [False] * n
        errors: list[str | None] = [None] * n
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
                    w.conn.send((idx, responses[idx], truths[idx]))
                except OSError:  # the worker died while idle: this answer is an error
                    errors[idx] = "worker died"
                    remaining -= 1
                    idle.append(self._replace(w))
                    restarts += 1
                    continue
                w.sent = time.monotonic()
                w.task, w.deadline = idx, w.sent + self.timeout_s
                busy[w.conn] = w
            if not busy:
                continue
            now = time.monotonic()
            nearest = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, nearest - now)):
                w = busy.pop(conn)
                busy_time += time.monotonic() - w.sent
                try:
                    idx, score, err = conn.recv()
                except (EOFError, OSError):  # the worker died (e.g. killed by the OOM killer)
                    idx, score, err = w.task, 0.0, "worker died"
                    w = self._replace(w)
                    restarts += 1
                scores[idx], errors[idx] = float(score), err
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
        n_to, n_err = sum(timed_out), sum(e is not None for e in errors)
        for key, value in (("pairs", n), ("timeouts", n_to), ("errors", n_err)):
            self.totals[key] += value
        self.totals["restarts"] += restarts
        self.totals["seconds"] += elapsed
        metrics = {
            "math_reward/pairs": n,
            "math_reward/timeouts": n_to,
            "math_reward/timeout_share": n_to / n if n else 0.0,
            "math_reward/errors": n_err,
            "math_reward/seconds": elapsed,
            "math_reward/pairs_per_s": n / elapsed if elapsed > 0 else 0.0,
            "math_reward/worker_busy_share": (
                busy_time / (elapsed * self.n_workers) if elapsed > 0 else 0.0
            ),
        }
        return MathScores(scores, timed_out, errors, metrics)

    def worker_cpu_seconds(self) -> float:
        """CPU seconds used by all workers so far, the replaced ones included (Linux)."""
        live = sum(process_cpu_seconds(w.proc.pid) for w in self._workers if w.proc.is_alive())
        return self._killed_cpu + live

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self._killed_cpu += w.cpu_at_exit
        fresh = _Worker(self._ctx, self._soft)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

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
    scores 0.0 and is counted in `default_pool().totals`).
    """
    return default_pool().score([response], [ground_truth]).scores[0]
