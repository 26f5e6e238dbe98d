"""Reading a W&B run file (RUN_DIR/wandb/*-run-*/run-<id>.wandb) back, for tests: the wandb
package writes it (its Go core) and has no Python reader since it moved there, so this reads the
container, a LevelDB log (32 KiB blocks of records with a 7-byte header: CRC-32C, length, type)
after W&B's 7-byte header, and parses each record with the package's own protobuf `Record`.

    history(path) -> [{"_step": 1, "reward_mean": 0.5, ...}, ...]
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every protobuf Record of the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a record cut short (the writer was killed)
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
        elif kind == 0 and length == 0:  # padding to the block's end
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0
    return [wandb_internal_pb2.Record.FromString(c) for c in out]


def history(path: Path) -> list[dict]:
    """The run's history rows (wandb.log calls): item key -> decoded JSON value."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item
            }
            rows.append(row)
    return rows


def wait_for_exit_record(path: Path, timeout: float = 60.0) -> None:
    """Wait until the run file holds its `exit` record. wandb 0.31's `finish()` can return
    before its core process has written the file (seen here: 7 bytes right after, all of it a
    second later); the process's own exit waits for it."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.WhichOneof("record_type") == "exit" for r in records(path)):
            return
        time.sleep(0.2)
    raise AssertionError(f"{path}: no exit record after {timeout} s")
