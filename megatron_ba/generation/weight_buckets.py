"""Weight buckets: HF-named tensors packed into one shared buffer and handed to a vLLM engine.

    for bucket in iter_buckets(named_tensors, limit_bytes=256 << 20):   # [(name, tensor), ...]
        manifest = shared.write(bucket)          # SharedBucket: one buffer, reused for every bucket
        engine_rpc(shared.handle, manifest)      # the engine opens the handle, unpacks, loads
    shared.close()

The engine runs in a process of its own (vLLM's V1 front end; see vllm_engine.py), and tensors
passed as RPC arguments do not survive vLLM's msgpack encoding, so the bytes travel through
memory both processes can map and only a small handle and manifest (strings and ints) travel as
arguments:
- CPU: a POSIX shared-memory segment (a file of /dev/shm, a RAM-backed tmpfs, never a disk),
  mapped with `torch.from_file(shared=True)` on both sides;
- CUDA: one device buffer exported as a CUDA IPC handle (torch.multiprocessing's
  `reduce_tensor`, the mechanism NeMo-RL and verl use), rebuilt in the engine's process.
Same code path otherwise. Pure torch; no torch.distributed, no vLLM.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Iterable, Iterator

import torch

# Layout rows: (HF name, shape, dtype name, byte offset). Offsets are aligned so that every view
# of the uint8 buffer is aligned for its dtype.
_ALIGN = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], *, limit_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of (name, tensor), in order, each at most `limit_bytes` (aligned); a
    tensor larger than the limit travels alone in a bucket of its own."""
    if limit_bytes < 1:
        raise ValueError(f"limit_bytes: must be >= 1, got {limit_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        need = _aligned(tensor_bytes(t))
        if bucket and size + need > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += need
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor) -> list:
    """Copy the bucket's tensors into the uint8 `buffer`; the manifest that `unpack` reads."""
    manifest, offset = [], 0
    for name, t in bucket:
        n = tensor_bytes(t)
        if offset + n > buffer.numel():
            raise ValueError(
                f"buffer: {buffer.numel()} bytes cannot hold {name!r} ({n} bytes) at {offset}"
            )
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + n].copy_(src)
        manifest.append((name, list(t.shape), _dtype_name(t.dtype), offset))
        offset = _aligned(offset + n)
    return manifest


def unpack(buffer: torch.Tensor, manifest: list) -> list[tuple[str, torch.Tensor]]:
    """Views of the uint8 `buffer` as the manifest's named tensors (no copy)."""
    out = []
    for name, shape, dtype, offset in manifest:
        dt = getattr(torch, dtype)
        numel = 1
        for s in shape:
            numel *= s
        raw = buffer[offset : offset + numel * dt.itemsize]
        out.append((name, raw.view(dt).reshape(shape)))
    return out


class SharedBucket:
    """One buffer of `capacity` bytes on `device`, mapped by the engine's process through
    `handle` (a dict of strings / bytes: msgpack-safe). Reused for every bucket of every refit;
    grows when a bucket (a single tensor larger than the limit) needs more."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1 byte, got {capacity}")
        self.device = torch.device(device)
        self.path: str | None = None
        self._allocate(_aligned(capacity))

    def _allocate(self, capacity: int) -> None:
        self.close()
        self.capacity = capacity
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            rebuild, args = reduce_tensor(self.buffer)
            self.handle = {"kind": "cuda_ipc", "payload": pickle.dumps((rebuild, args))}
        elif self.device.type == "cpu":
            self.path = f"/dev/shm/megatron-ba-refit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.buffer = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
            self.handle = {"kind": "shm", "path": self.path, "size": capacity}
        else:
            raise ValueError(f"device: weight buckets support cpu and cuda, got {self.device}")

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> list:
        """Pack `bucket` into the buffer (growing it if needed); the manifest for the engine."""
        need = sum(_aligned(tensor_bytes(t)) for _, t in bucket)
        if need > self.capacity:
            self._allocate(_aligned(need))
        manifest = pack(bucket, self.buffer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the engine's process reads it next
        return manifest

    def close(self) -> None:
        """Drop the buffer and remove the shared-memory segment (CPU)."""
        self.buffer = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def open_bucket(handle: dict, device: torch.device | None = None) -> torch.Tensor:
    """The uint8 buffer behind `handle`, in the engine's process (no copy).

    device: for a CUDA handle, the engine worker's device (a handle names the exporter's
    device index; the engine may see another numbering).
    """
    kind = handle.get("kind")
    if kind == "shm":
        return torch.from_file(handle["path"], shared=True, size=handle["size"], dtype=torch.uint8)
    if kind == "cuda_ipc":
        rebuild, args = pickle.loads(handle["payload"])
        if device is not None:
            args = list(args)
            args[6] = torch.device(device).index  # rebuild_cuda_tensor's storage_device
        return rebuild(*args)
    raise ValueError(f"handle: unknown bucket transport {kind!r} (expected 'shm' or 'cuda_ipc')")
