"""Wait until a Ray cluster has the nodes a Slurm job started (slurm/lib.sh, backends verl and
nemo_rl): a head on the allocation's first node, one worker on each other node.

    python -m megatron_ba.integrations.ray_cluster wait --address HOST:PORT --nodes N \
        [--hosts "h1 h2 ..."] [--timeout 600] [--every 5]

Exit 0 once N live nodes have joined; exit 1 after --timeout seconds or on SIGUSR2 (the launcher's
"a node's Ray step ended"), naming what is missing (the hosts of --hosts that have not joined, or
how many nodes); exit 2 on bad arguments. A node is named by its Slurm node name where the
launcher gave it one (the resource slurm-node/NAME), else by its short host name. It imports only
Ray (the job's environment has it; the project's CPU environment need not).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


class RayWaitError(RuntimeError):
    """The cluster did not reach the wanted size in time: the message says what is missing."""


# Set by SIGUSR2 (slurm/lib.sh: a node's Ray step ended, so that node cannot join): the wait
# reports what it saw at its next poll and stops.
_given_up = False
GAVE_UP = " (a node's Ray step ended: not waiting any longer)"


def _pause(seconds: float) -> None:
    """Sleep `seconds`, or less once the wait has been told to give up."""
    end = time.monotonic() + seconds
    while not _given_up and time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def _short(host: str) -> str:
    return host.split(".", 1)[0]


# slurm/lib.sh starts each Ray node with the resource slurm-node/<its Slurm node name>: the name
# the wait reports, which can differ from the node's host name (Slurm's NodeHostname).
NODE_RESOURCE = "slurm-node/"


def node_name(node: dict) -> str:
    """A node of `ray.nodes()` by its Slurm node name, else its short host name."""
    for key in node.get("Resources") or {}:
        if key.startswith(NODE_RESOURCE):
            return key[len(NODE_RESOURCE) :]
    return _short(node.get("NodeManagerHostname", "?"))


def live_hosts(nodes: list[dict]) -> list[str]:
    """The names (node_name) of the live nodes in `ray.nodes()`'s records."""
    return sorted(node_name(n) for n in nodes if n.get("Alive"))


def missing_message(
    address: str, want: int, hosts: list[str], joined: list[str], waited: float
) -> str:
    """What a timeout reports: how many joined, which ones, and which hosts are missing."""
    text = (
        f"Ray cluster at {address}: {len(joined)} of {want} node(s) joined after {waited:.0f} s"
        f" ({', '.join(joined) or 'none'})"
    )
    missing = [h for h in hosts if _short(h) not in joined]
    if missing:
        text += f"; missing: {', '.join(missing)}"
    return text


def _connect(address: str, deadline: float, every: float):
    """ray, connected to the cluster at `address` as a driver; retried until `deadline` (the head
    may still be starting)."""
    import ray

    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return ray
        except Exception as e:  # ConnectionError, or Ray's own when no GCS answers yet
            if _given_up or time.monotonic() + every > deadline:
                gave_up = GAVE_UP if _given_up else ""
                raise RayWaitError(f"no Ray head answers at {address}: {e}{gave_up}") from e
            _pause(every)


def wait_for_nodes(
    address: str, want: int, *, hosts=(), timeout=600.0, every=5.0, seen: list | None = None
) -> list[str]:
    """Poll `ray.nodes()` until `want` live nodes; return their short host names. Raises
    RayWaitError after `timeout` seconds with missing_message's text. `seen`, when given, holds
    the hosts of the latest poll (for a watchdog's message)."""
    start = time.monotonic()
    deadline = start + timeout
    ray = _connect(address, deadline, every)
    try:
        while True:
            joined = live_hosts(ray.nodes())
            if seen is not None:
                seen[:] = joined
            if len(joined) >= want:
                return joined
            if _given_up or time.monotonic() + every > deadline:
                waited = time.monotonic() - start
                text = missing_message(address, want, list(hosts), joined, waited)
                raise RayWaitError(text + (GAVE_UP if _given_up else ""))
            _pause(every)
    finally:
        ray.shutdown()


def _watchdog(seconds: float, message) -> None:
    """Exit 1 after `seconds` whatever the main thread is doing: a call into Ray (ray.init,
    ray.nodes) can block past the wait's own deadline, and the job must not hang on it."""

    def fire() -> None:
        print(f"ray_cluster: {message()} (Ray did not answer)", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def _give_up_on(signum: int) -> None:
    """On `signum`, end the wait at its next poll with what it saw: slurm/lib.sh sends SIGUSR2
    when a node's Ray step has ended (that node cannot join), so the job need not wait out
    --timeout."""

    def give_up(_signum, _frame) -> None:
        global _given_up
        _given_up = True

    signal.signal(signum, give_up)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ba.integrations.ray_cluster")
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wait", help="wait until N nodes have joined the Ray cluster")
    w.add_argument("--address", required=True, help="the head's HOST:PORT")
    w.add_argument("--nodes", type=_positive(int), required=True, help="how many nodes to wait for")
    w.add_argument("--hosts", default="", help="the expected hosts (space-separated), for messages")
    w.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds (default 600)")
    w.add_argument("--every", type=_positive(float), default=5.0, help="poll period, seconds")
    args = p.parse_args(argv)
    if ":" not in args.address:
        p.error(f"--address {args.address}: expected HOST:PORT")
    hosts, seen = args.hosts.split(), []
    _watchdog(args.timeout + 15, lambda: missing_message(args.address, args.nodes, hosts, seen,
                                                         args.timeout + 15))  # fmt: skip
    _give_up_on(signal.SIGUSR2)
    # after the handler is set: a sender that reads this line may signal from then on
    print(f"ray_cluster: waiting for {args.nodes} node(s) at {args.address} (up to "
          f"{args.timeout:g} s)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        joined = wait_for_nodes(args.address, args.nodes, hosts=hosts, timeout=args.timeout,
                                every=args.every, seen=seen)  # fmt: skip
    except RayWaitError as e:
        print(f"ray_cluster: {e}", file=sys.stderr)
        return 1
    print(f"ray_cluster: {len(joined)} node(s) joined at {args.address}: {' '.join(joined)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
