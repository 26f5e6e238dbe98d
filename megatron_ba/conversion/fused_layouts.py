"""The row layouts of megatron-core's fused tensors against Hugging Face's separate ones.

    q, k, v = split_qkv(linear_qkv, heads, groups, head_dim)       # and merge_qkv, the inverse
    q, k, v = split_gated_qkv(linear_qkv, heads, groups, head_dim) # with the output gate
    qkv, z, b, a = split_in_proj(in_proj, spec)                    # a Gated DeltaNet's in_proj
    gate, up = split_gated(linear_fc1)

Each split is the exact inverse of its merge (a reshape and a permutation of rows: no
arithmetic, so HF -> megatron -> HF gives the same bits). The layouts are described with the
rules that use them in family_table's docstring.
"""

from __future__ import annotations

import torch


def split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int):
    """megatron [groups * (r + 2) * head_dim, ...] -> q [heads * head_dim, ...], k, v."""
    r = heads // groups
    rest = t.shape[1:]
    if t.shape[0] != groups * (r + 2) * head_dim:
        raise ValueError(
            f"linear_qkv: {t.shape[0]} rows, expected groups*(heads/groups+2)*head_dim = "
            f"{groups}*({r}+2)*{head_dim}"
        )
    g = t.reshape(groups, r + 2, head_dim, *rest)
    q = g[:, :r].reshape(heads * head_dim, *rest)
    k = g[:, r].reshape(groups * head_dim, *rest)
    v = g[:, r + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def merge_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    r = heads // groups
    rest = q.shape[1:]
    for what, t, rows in (("q", q, heads), ("k", k, groups), ("v", v, groups)):
        if t.shape[0] != rows * head_dim:
            raise ValueError(f"{what}_proj: {t.shape[0]} rows, expected {rows} * {head_dim}")
    fused = torch.cat(
        [
            q.reshape(groups, r, head_dim, *rest),
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def split_gated_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int):
    """megatron [groups * (2r + 2) * head_dim, ...] -> HF q_proj [heads * 2 * head_dim, ...]
    (per head [q_h; gate_h]), k, v; see the module docstring."""
    r = heads // groups
    rest = t.shape[1:]
    if t.shape[0] != groups * (2 * r + 2) * head_dim:
        raise ValueError(
            f"linear_qkv: {t.shape[0]} rows, expected groups*(2*heads/groups+2)*head_dim = "
            f"{groups}*(2*{r}+2)*{head_dim} (attention with an output gate)"
        )
    g = t.reshape(groups, 2 * r + 2, head_dim, *rest)
    q_and_gate = torch.stack([g[:, :r], g[:, r : 2 * r]], dim=2)  # [groups, r, 2, d, ...]
    q = q_and_gate.reshape(2 * heads * head_dim, *rest)
    k = g[:, 2 * r].reshape(groups * head_dim, *rest)
    v = g[:, 2 * r + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def merge_gated_qkv(q, k, v, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """The inverse of `split_gated_qkv`."""
    r = heads // groups
    rest = q.shape[1:]
    for what, t, rows in (("q", q, 2 * heads), ("k", k, groups), ("v", v, groups)):
        if t.shape[0] != rows * head_dim:
            raise ValueError(f"{what}_proj: {t.shape[0]} rows, expected {rows} * {head_dim}")
    per_head = q.reshape(groups, r, 2, head_dim, *rest)
    fused = torch.cat(
        [
            per_head[:, :, 0],
            per_head[:, :, 1],
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def in_proj_sections(spec) -> tuple[int, int, int, int]:
    """Rows of a Gated DeltaNet's in_proj parts: (q; k; v), z, b, a."""
    kd = spec.linear_num_key_heads * spec.linear_key_head_dim
    vd = spec.linear_num_value_heads * spec.linear_value_head_dim
    nv = spec.linear_num_value_heads
    return 2 * kd + vd, vd, nv, nv


def split_in_proj(t: torch.Tensor, spec):
    """megatron in_proj -> HF (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    sections = in_proj_sections(spec)
    if t.shape[0] != sum(sections):
        raise ValueError(f"in_proj: {t.shape[0]} rows, expected {' + '.join(map(str, sections))}")
    return t.split(sections, dim=0)


def merge_in_proj(qkv, z, b, a, spec) -> torch.Tensor:
    """The inverse of `split_in_proj`."""
    parts = zip(("qkv", "z", "b", "a"), (qkv, z, b, a), in_proj_sections(spec), strict=True)
    for what, t, rows in parts:
        if t.shape[0] != rows:
            raise ValueError(f"in_proj_{what}: {t.shape[0]} rows, expected {rows}")
    return torch.cat([qkv, z, b, a], dim=0)


def split_gated(t: torch.Tensor):
    """megatron linear_fc1 [gate; up] -> (gate, up)."""
    gate, up = t.chunk(2, dim=0)
    return gate, up


def merge_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)
