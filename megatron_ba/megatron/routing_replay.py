"""Routing replay: megatron-core's MoE routers take the experts the rollout engine chose.

    fields = routing_replay_fields(spec.num_experts, ParallelLayout(), recompute="none")
    config = transformer_config(spec, **fields)            # moe_enable_routing_replay=True
    per_layer = microbatch_routing(routed[rows], width)    # [b, S, L, K] -> L x [width*b, K]
    with replaying(model, per_layer):                      # REPLAY_FORWARD for this forward
        logits = model(tokens, positions, mask)

A mixture-of-experts policy routes each token to its top-k experts; the rollout engine (another
kernel, another dtype) may pick other experts than the trainer for the same token, and a routing
flip changes that token's log-prob by far more than the arithmetic does. With
`rollout.routing_replay` the engine records the experts of every token it fed to the model
(generation/vllm_routing.py) and the trainer's old-log-prob and training forwards replay them
through megatron-core's own RouterReplay (transformer/moe/router_replay.py, the same API in
megatron-core 0.16.1 and 0.19.2): the router's scores are gathered at the replayed experts, so
the router still gets gradients, while the choice is the engine's. The load-balancing aux loss
keeps its own top-k (megatron-core computes it from the scores).

Token layout: `routed` is token-aligned ([N, S, L, K]: entry [i, t] holds the experts of token t
of row i as an input, L the MoE layers in model order); a micro-batch's [b, width] tokens reach
the router as [width * b] rows in megatron-core's [s, b] order. Positions the engine never fed
(the last sampled token, padding) hold experts 0..K-1: their outputs predict nothing the loss
reads (causal attention; no expert capacity, so no token is dropped for them).
"""

from __future__ import annotations

import contextlib

import torch

KEY = "rollout.routing_replay"


def routing_replay_fields(num_experts: int | None, layout, *, recompute: str) -> dict:
    """TransformerConfig fields that turn routing replay on; ValueError naming KEY where this
    build cannot replay (a dense model, a megatron-core without RouterReplay, or a layout whose
    router input is not the whole micro-batch in [s, b] order); `layout`: the run's
    ParallelLayout."""
    if not num_experts:
        raise ValueError(f"{KEY}: the model is dense (model.num_experts is 0): nothing to replay")
    for key, value in (
        ("parallel.tp", layout.tp),
        ("parallel.pp", layout.pp),
        ("parallel.cp", layout.cp),
    ):
        if value != 1:
            raise ValueError(
                f"{KEY}: replays whole micro-batches on one model-parallel rank; {key}={value} "
                "is not supported with it yet"
            )
    if recompute != "none":
        raise ValueError(
            f"{KEY}: parallel.recompute={recompute} would recompute the routing in backward "
            "without the replayed experts; use parallel.recompute=none"
        )
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{KEY}: this megatron-core has no moe/router_replay.py") from e
    if "moe_enable_routing_replay" not in TransformerConfig.__dataclass_fields__:
        raise ValueError(f"{KEY}: this megatron-core's TransformerConfig has no routing replay")
    return {"moe_enable_routing_replay": True}


def check_replayable(*, thd: bool, cp_sharded: bool) -> None:
    """ValueError naming KEY for micro-batches whose router rows are not [width * b] in [s, b]
    order of padded whole sequences."""
    if thd or cp_sharded:
        raise ValueError(
            f"{KEY}: replays padded whole-sequence micro-batches; packed (THD) or CP-sharded "
            "model inputs are not supported with it"
        )


def replay_instances(model: torch.nn.Module) -> list:
    """The RouterReplay of every MoE router of `model`, in layer order (not megatron-core's
    class-global list, which also holds the routers of every other model built in the
    process, e.g. the reference policy)."""
    return [
        m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None
    ]


def microbatch_routing(routed: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Per MoE layer, [width * b, K] int64 experts in megatron-core's [s, b] order, from the
    token-aligned [b, S, L, K] `routed` of a micro-batch's rows, cut or filled (experts
    0..K-1) to `width` positions."""
    if routed.dim() != 4:
        raise ValueError(f"routed_experts: must be [N, S, L, K], got {tuple(routed.shape)}")
    b, s, layers, k = routed.shape
    out = torch.arange(k, dtype=torch.long, device=routed.device).expand(b, width, layers, k)
    out = out.clone()
    w = min(width, s)
    out[:, :w] = routed[:, :w].long()
    sb = out.transpose(0, 1).reshape(width * b, layers, k)  # [s, b] order, flattened
    return [sb[:, i].contiguous() for i in range(layers)]


@contextlib.contextmanager
def replaying(model: torch.nn.Module, per_layer: list[torch.Tensor] | None, differ=None):
    """`model`'s forwards inside take the experts of `per_layer` (nothing happens for None).

    differ: a list that gets, per MoE layer and forward, a [tokens] bool tensor: True where the
    router's own top-k set differs from the replayed one (the routing mismatch diagnostic).
    """
    if per_layer is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    instances = replay_instances(model)
    if len(instances) != len(per_layer):
        raise ValueError(
            f"{KEY}: the batch holds the experts of {len(per_layer)} MoE layers, the model has "
            f"{len(instances)} routers with replay"
        )
    for inst, experts in zip(instances, per_layer, strict=True):
        inst.set_target_indices(experts)
        inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if differ is not None:
            inst.get_replay_topk = _comparing(inst, differ)
    try:
        yield
    finally:
        for inst in instances:
            inst.clear_indices()
            inst.clear_router_replay_action()
            inst.__dict__.pop("get_replay_topk", None)


def _comparing(inst, differ: list):
    """`inst.get_replay_topk` that also computes the router's own top-k and records where its
    set differs from the replayed experts."""
    replay = type(inst).get_replay_topk.__get__(inst)

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = inst.target_topk_idx.to(own.device)
        differ.append((own.sort(-1).values != target.sort(-1).values).any(-1))
        return replay(scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


def differ_counts(differ: list[torch.Tensor], parts: list[dict]) -> torch.Tensor:
    """[differing, counted] float64: (token, MoE layer) pairs whose router's own top-k differs
    from the replayed experts, and all pairs, over the positions the loss reads (each
    micro-batch's label-aligned `mask`); `differ` as `replaying` fills it over `parts`, in
    order (a forward-only schedule without pipelining)."""
    if not parts or len(differ) % len(parts):
        raise ValueError(f"differ: {len(differ)} entries for {len(parts)} micro-batches")
    layers = len(differ) // len(parts)
    out = torch.zeros(2, dtype=torch.float64)
    for j, mb in enumerate(parts):
        mask = mb["mask"].transpose(0, 1).reshape(-1)  # [s, b] order, as the router sees it
        for d in differ[j * layers : (j + 1) * layers]:
            out[0] += float((d & mask).sum())
            out[1] += float(mask.sum())
    return out
