"""Core attention through torch's `scaled_dot_product_attention`, for the local layer spec.

    spec = sdpa_layer_spec(local_layer_spec(qk_layernorm))   # or BuildOptions.layer_spec(spec)
    model = GPTModel(config, transformer_layer_spec=spec, ...)

megatron-core's local (Transformer-Engine-free) spec computes attention with its unfused
`DotProductAttention`, which materialises the scores and the probabilities, [b, heads, s, s]
each: memory quadratic in the length (two 28 x 16,384^2 bf16 tensors are 28 GiB). torch's
SDPA dispatches to flash or memory-efficient kernels on CUDA (and a flash-style kernel on CPU)
that keep O(s) per head, so long contexts run without Transformer Engine.

`SDPAttention` takes `DotProductAttention`'s constructor arguments and forward signature
(megatron-core 0.16 and 0.19 agree on both) and returns the same tensor: the context
[sq, b, heads_per_partition x head_dim]. It computes the same function:

* scores q k^T x softmax_scale (default 1 / sqrt(kv_channels); `apply_query_key_layer_scaling`
  divides the scale by the layer number and multiplies the scores back in the softmax: the same
  product, so it is ignored here);
* grouped-query attention: key/value head g serves query heads g x r ... (g + 1) x r - 1 with
  r = heads / groups (megatron-core's `repeat_interleave`), through SDPA's `enable_gqa` in half
  precision where torch has it (`gqa_in_kernel`), else by expanding k and v the same way;
* masks: megatron-core's boolean convention, True = cut. No mask with the causal mask type is
  causal attention (SDPA's `is_causal`, the flash path); a mask equal to the causal pattern
  (what megatron_ba's step passes on CPU, [1, 1, s, s]) takes the same path; any other mask
  (padding: [b, 1, sq, sk]) is passed to SDPA as its boolean mask, and a query that may attend
  to no key (a left-padding position) gets the mean of the values, with no gradient to its
  scores: what the unfused core's `masked_fill(-10000)` gives (weight 0 on cut keys, uniform
  weights on a row cut everywhere);
* tensor parallelism: q/k/v arrive with this rank's heads and groups (heads / TP each); the
  module checks their counts against the config.

What it refuses, each with a ValueError naming the setting: attention dropout (the step trains
with 0; SDPA's dropout would draw from a different generator than megatron-core's RNG tracker),
context parallelism inside the model (Transformer Engine's), packed (THD) sequences, an
attention bias, sliding windows, softmax offsets ("off-by-one", "learnable"), and qk-clip /
max-logit logging (they read the scores this module never forms).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megatron_ba.megatron import mcore_compat


def _refuse_unsupported(config, dropout: float) -> None:
    """ValueError naming the first setting this core cannot run."""
    if dropout != 0.0:
        raise ValueError(
            f"attention_dropout: model.attention sdpa runs without attention dropout, got "
            f"{dropout}; use model.attention: unfused for dropout"
        )
    if int(getattr(config, "context_parallel_size", 1)) != 1:
        raise ValueError(
            "context_parallel_size: model.attention sdpa does not run context parallelism inside "
            "the model (Transformer Engine's attention does); the local spec applies CP at the "
            "loss (build_options)"
        )
    if getattr(config, "window_size", None):
        raise ValueError(
            f"window_size: sliding-window attention ({config.window_size}) is not supported by "
            "model.attention sdpa"
        )
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise ValueError(
            f"softmax_type: model.attention sdpa computes the vanilla softmax, got {softmax_type!r}"
        )
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(config, flag, False):
            raise ValueError(
                f"{flag}: needs the attention logits, which model.attention sdpa never forms"
            )


def _tp_size(pg_collection) -> int:
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    if group is not None:
        return group.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def is_causal_pattern(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether a boolean `mask` (True = cut) of shape [1, 1, sq, sk] cuts exactly the keys after
    each query: then SDPA's `is_causal` computes the same attention (reads the mask: O(s^2))."""
    if mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, sq, sk) or sq != sk:
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask[0, 0], causal)


def attend_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's boolean mask (True = cut) as SDPA's (True = attend), and the queries cut
    from every key ([.., sq, 1]). Those (left-padding positions) attend to all keys here and
    their output is replaced by the mean of the values afterwards (`uniform_rows`): what the
    unfused core's masked_fill(-10000) gives, forward and backward (no gradient reaches their
    scores). SDPA itself gives such a row another value (zeros from torch 2.13's CPU kernel)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"attention_mask: must be a bool tensor (True = cut), got {mask.dtype}")
    rows_cut = mask.all(dim=-1, keepdim=True)
    return ~mask | rows_cut, rows_cut


def uniform_rows(out: torch.Tensor, value: torch.Tensor, rows_cut: torch.Tensor) -> torch.Tensor:
    """`out` [b, heads, sq, d] with the rows where `rows_cut` is True replaced by the mean of
    `value` [b, groups, sk, d] over the keys (each head its group's)."""
    mean = value.mean(dim=2, keepdim=True)
    mean = mean.repeat_interleave(out.shape[1] // value.shape[1], dim=1)
    return torch.where(rows_cut, mean, out)


def gqa_in_kernel(dtype: torch.dtype) -> bool:
    """Whether SDPA gets the grouped k/v as they are (`enable_gqa`) rather than expanded to one
    per query head. Only in half precision: there the flash kernels, which take grouped heads,
    can run; in fp32 CUDA's choice is the memory-efficient kernel, which did not take grouped
    heads in every torch release that has `enable_gqa`, and a refusal there falls back to the
    math kernel, quadratic in memory. Expanded k/v cost (heads - groups) x head_dim x 2 values
    per token and layer."""
    return dtype in (torch.float16, torch.bfloat16) and mcore_compat.sdpa_has_enable_gqa()


class SDPAttention(MegatronModule):
    """Drop-in core attention for megatron-core's SelfAttention (see the module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        _refuse_unsupported(config, float(dropout))
        tp = _tp_size(pg_collection)
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(config, name) % tp:
                raise ValueError(f"{name}: {getattr(config, name)} is not a multiple of tp={tp}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        )
        # Read by megatron-core 0.19's inference path and qk-clip; neither exists here.
        self.softmax_offset = None
        self.current_max_attn_logits = None

    def _mask_arguments(self, attention_mask, mask_type, sq: int, sk: int) -> dict:
        """SDPA's keyword arguments for megatron-core's (mask, mask type), plus "rows_cut" (the
        queries cut from every key, see attend_mask) with an explicit non-causal mask."""
        from megatron.core.transformer.enums import AttnMaskType

        if mask_type != self.attn_mask_type:
            raise ValueError(
                f"attn_mask_type: {mask_type} differs from the {self.attn_mask_type} this layer "
                "was built with"
            )
        if attention_mask is None:
            # As the unfused core: only the causal type implies a mask when none is passed.
            if mask_type != AttnMaskType.causal:
                return {}
            if sq != sk:
                raise ValueError(
                    f"attention_mask: causal attention without a mask needs as many queries as "
                    f"keys, got {sq} and {sk}; pass the mask"
                )
            return {"is_causal": True}
        if is_causal_pattern(attention_mask, sq, sk):
            return {"is_causal": True}
        if attention_mask.shape[-2:] != (sq, sk):
            raise ValueError(
                f"attention_mask: last two dims must be (queries, keys) = ({sq}, {sk}), got "
                f"{tuple(attention_mask.shape)}"
            )
        attend, rows_cut = attend_mask(attention_mask)
        return {"attn_mask": attend, "rows_cut": rows_cut}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """q [sq, b, heads, d], k / v [sk, b, groups, d] (this rank's) -> [sq, b, heads x d]."""
        if packed_seq_params is not None:
            raise ValueError("packed_seq_params: packed (THD) sequences need Transformer Engine")
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by model.attention sdpa")
        sq, b, heads, d = query.shape
        sk, groups = key.shape[0], key.shape[2]
        if (heads, groups) != (self.heads_per_partition, self.groups_per_partition):
            raise ValueError(
                f"query/key: {heads} heads and {groups} groups on this rank, the config says "
                f"{self.heads_per_partition} and {self.groups_per_partition}"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        kwargs = self._mask_arguments(attention_mask, mask_type, sq, sk)
        rows_cut = kwargs.pop("rows_cut", None)
        # SDPA's layout is [b, heads, s, d]: views of megatron-core's [s, b, heads, d].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if heads != groups:
            if gqa_in_kernel(query.dtype):
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(heads // groups, dim=1)
                v = v.repeat_interleave(heads // groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.0, scale=self.softmax_scale, **kwargs
        )
        if rows_cut is not None:
            out = uniform_rows(out, value.permute(1, 2, 0, 3), rows_cut)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def sdpa_layer_spec(layer_spec):
    """A copy of a local layer spec whose self-attention core is SDPAttention."""
    attention = layer_spec.submodules.self_attention
    if "core_attention" not in {f.name for f in dataclasses.fields(attention.submodules)}:
        raise ValueError("layer_spec: its self_attention has no core_attention submodule")
    submodules = dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(
        layer_spec,
        submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention),
    )
