"""Hugging Face's two ways of storing a MoE layer's experts: one tensor per expert, or fused.

    views = expert_views(shapes)                  # per-expert name -> (fused name, e, part)
    t = read_view(views[name], read_expert)       # one expert's slice of a fused tensor
    stream = fuse_experts(stream, fused_counts)   # per-expert stream -> the fused tensors

transformers 5 holds experts fused (Qwen3NextExperts, Qwen3MoeExperts: `mlp.experts.gate_up_proj`
[E, 2 I, H], expert e's rows [gate (I); up (I)], and `mlp.experts.down_proj` [E, H, I]) and
saves them per expert (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H,
I]: its conversion mapping's reverse, as model.safetensors of save_pretrained shows). Published
Qwen3.5-MoE checkpoints (Qwen3.5-35B-A3B: gate_up_proj (256, 1024, 2048), down_proj (256, 2048,
512)) ship the fused form for the decoder's layers and per-expert tensors for the MTP layer;
vLLM's Qwen3.5-MoE loader reads both. The conversion tables name experts one by one: a fused
checkpoint is read through per-expert views (each a slice, read alone), and written back fused
when its source was (`fuse_experts`), so either form converts back bit for bit.

A fused pair is recognised by name and by its shapes agreeing with the layout above
(gate_up_proj [E, 2 I, H] beside down_proj [E, H, I]); a transposed pair (Qwen3-VL-MoE's
[E, H, 2 I]) is not, and stays as stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

FUSED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>\w+_proj)\.weight$")
PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

# A view: (the stored fused tensor's name, the expert, the part: gate_proj, up_proj, down_proj)
View = tuple[str, int, str]


def expert_views(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, View]:
    """The per-expert names of the fused expert tensors among `shapes` (name -> shape)."""
    views: dict[str, View] = {}
    for name, shape in shapes.items():
        m = FUSED.match(name)
        if m is None or m["kind"] != "gate_up_proj":
            continue
        down = f"{m['experts']}.down_proj"
        down_shape = shapes.get(down)
        if not _fused_pair(tuple(shape), None if down_shape is None else tuple(down_shape)):
            continue
        for e in range(shape[0]):
            for stored, parts in ((name, PARTS["gate_up_proj"]), (down, PARTS["down_proj"])):
                for part in parts:
                    views[f"{m['experts']}.{e}.{part}.weight"] = (stored, e, part)
    return views


def _fused_pair(gate_up: tuple[int, ...], down: tuple[int, ...] | None) -> bool:
    return (
        down is not None
        and len(gate_up) == 3
        and len(down) == 3
        and gate_up[0] == down[0]
        and gate_up[1] == 2 * down[2]
        and gate_up[2] == down[1]
    )


def read_view(view: View, read_expert: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """Expert e's part of a fused tensor; `read_expert(name, e)` reads the fused tensor's [e]."""
    stored, e, part = view
    t = read_expert(stored, e)
    if part == "down_proj":
        return t.contiguous()
    gate, up = t.chunk(2, dim=0)
    return (gate if part == "gate_proj" else up).contiguous()


def fused_counts(views: Mapping[str, View]) -> dict[str, int]:
    """Each fused tensor of `views` -> its number of experts."""
    counts: dict[str, int] = {}
    for stored, e, _ in views.values():
        counts[stored] = max(counts.get(stored, 0), e + 1)
    return counts


def fuse_experts(
    stream: Iterable[tuple[str, torch.Tensor]], counts: Mapping[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with the per-expert tensors of the fused tensors in `counts` (fused name ->
    experts) replaced by the fused tensors, each yielded once its last part has passed (the
    buffer holds at most what a layer's experts are while they stream by); the others as they
    come. ValueError if the stream ends with a fused tensor incomplete."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in stream:
        m = PER_EXPERT.match(name)
        stored = _fused_name(m) if m is not None else None
        if stored is None or stored not in counts:
            yield name, t
            continue
        parts = pending.setdefault(stored, {})
        parts[(int(m["e"]), m["part"])] = t
        kind = stored.rsplit(".", 1)[1]
        if len(parts) == counts[stored] * len(PARTS[kind]):
            yield stored, _stack(pending.pop(stored), counts[stored], PARTS[kind])
    if pending:
        raise ValueError(f"experts: incomplete fused expert tensors {sorted(pending)[:3]}")


def _fused_name(m: re.Match) -> str | None:
    for kind, parts in PARTS.items():
        if m["part"] in parts:
            return f"{m['experts']}.{kind}"
    return None


def _stack(parts: dict[tuple[int, str], torch.Tensor], n: int, names: tuple[str, ...]):
    return torch.stack([torch.cat([parts[(e, p)] for p in names], dim=0) for e in range(n)])
