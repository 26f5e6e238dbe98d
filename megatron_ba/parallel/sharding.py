"""Where each rank's piece of a tensor lies: tensor-parallel shards and context-parallel chunks.

Pure torch, no process groups: the collectives in megatron_ba.parallel.collectives move the pieces,
this module says which piece is which, so both can be tested apart.

Tensor parallelism (megatron-core's layout of a sharded parameter): a full tensor is split along
`dim` into `stride * size` equal blocks and rank r holds blocks r, r + size, r + 2 size, ...
concatenated. stride is 1 for most layers; SwiGLU's fused `linear_fc1` has stride 2 (its full
weight is [gate; up] and every rank holds [gate_r; up_r]). A fused weight of unequal parts gives
`stride` as the tuple of the parts' full sizes along `dim`: each part is split over the ranks and
rank r holds its piece of every part, in order (megatron-core's Gated DeltaNet: in_proj rows
[q; k; v; z; beta; alpha], every rank [q_r; k_r; v_r; z_r; beta_r; alpha_r]).

Context parallelism (megatron-core's load-balanced causal layout): a sequence of length S is cut
into 2 * cp equal chunks and rank r holds chunks r and 2 cp - 1 - r, in that order. Under causal
attention the early chunks are cheap and the late ones expensive; pairing chunk r with its mirror
gives every rank the same work. The positions a rank holds are `cp_positions(S, cp, r)`.
"""

from __future__ import annotations

import torch


def _check_rank(name: str, rank: int, size: int) -> None:
    if not (isinstance(size, int) and size >= 1):
        raise ValueError(f"{name}: the group size must be an integer >= 1, got {size!r}")
    if not (isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(f"{name}: rank must be in [0, {size}), got {rank!r}")


Stride = int | tuple[int, ...]


def _check_sections(name: str, length: int, sections: tuple[int, ...], size: int) -> None:
    if sum(sections) != length or any(s % size for s in sections):
        raise ValueError(
            f"{name}: parts {sections} must add up to the dimension's {length} and each split "
            f"over the tensor-parallel size {size}"
        )


def tp_shard(full: torch.Tensor, *, dim: int, stride: Stride, rank: int, size: int) -> torch.Tensor:
    """The piece of `full` that tensor-parallel rank `rank` of `size` holds (a copy)."""
    _check_rank("tp_shard", rank, size)
    if isinstance(stride, tuple):
        _check_sections("tp_shard", full.shape[dim], stride, size)
        parts = torch.split(full, list(stride), dim=dim)
        return torch.cat([torch.chunk(p, size, dim=dim)[rank] for p in parts], dim=dim).clone()
    blocks = stride * size
    if full.shape[dim] % blocks:
        raise ValueError(
            f"tp_shard: dimension {dim} of size {full.shape[dim]} does not split into "
            f"{blocks} blocks (stride {stride} x tensor-parallel size {size})"
        )
    pieces = torch.chunk(full, blocks, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim).clone()


def tp_unshard(shards: list[torch.Tensor], *, dim: int, stride: Stride) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from every rank's shard (in rank order)."""
    size = len(shards)
    if size == 0:
        raise ValueError("tp_unshard: needs at least one shard")
    if isinstance(stride, tuple):
        _check_sections("tp_unshard", sum(s.shape[dim] for s in shards), stride, size)
        local = [torch.split(s, [p // size for p in stride], dim=dim) for s in shards]
        return torch.cat([local[r][j] for j in range(len(stride)) for r in range(size)], dim=dim)
    per_rank = [torch.chunk(s, stride, dim=dim) for s in shards]
    if any(len(p) != stride for p in per_rank):
        raise ValueError(f"tp_unshard: every shard must split into stride={stride} blocks")
    # Block j of the full tensor is piece j // size of rank j % size.
    return torch.cat([per_rank[j % size][j // size] for j in range(stride * size)], dim=dim)


def check_cp_length(seq_len: int, cp: int) -> None:
    if cp < 1:
        raise ValueError(f"cp: the context-parallel size must be >= 1, got {cp}")
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len: context parallelism of size {cp} cuts sequences into 2 x {cp} = {2 * cp} "
            f"equal chunks, so the padded length must be a multiple of {2 * cp}, got {seq_len}"
        )


def cp_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions context-parallel rank `rank` holds, in its local order."""
    _check_rank("cp_positions", rank, cp)
    if cp == 1:
        return torch.arange(seq_len)
    check_cp_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    mirror = 2 * cp - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk)
    return torch.cat([first, second])


def cp_shard(x: torch.Tensor, *, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along the sequence dimension `dim` (megatron-core's CP layout)."""
    if cp == 1:
        return x
    idx = cp_positions(x.shape[dim], cp, rank).to(x.device)
    return x.index_select(dim, idx)


def cp_unshard(parts: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """Inverse of `cp_shard`: the whole sequence from every CP rank's part (in rank order)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    seq_len = sum(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[dim] = seq_len
    out = parts[0].new_empty(shape)
    for r, p in enumerate(parts):
        out.index_copy_(dim, cp_positions(seq_len, cp, r).to(p.device), p)
    return out
