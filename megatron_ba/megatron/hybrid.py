"""Qwen3.5's hybrid decoder as a megatron-core GPTModel: Gated DeltaNet and gated full attention.

    config = transformer_config(spec)              # model.py merges hybrid_config_fields(spec)
    block = hybrid_block_spec(config, spec)        # one layer spec per layer, this build's modules
    GPTModel(config, block, ..., rotary_percent=spec.rotary_percent)

The layers, from transformers 5.19's Qwen3.5 (models/qwen3_5, which inherits Qwen3-Next's):
- a Gated DeltaNet layer (`linear_attention_pattern` 1) is megatron-core's own `GatedDeltaNet`
  (megatron/core/ssm/gated_delta_net, 0.16.1 and 0.19.2): one input projection to q, k, v, the
  output gate z, beta and alpha, a causal depthwise conv1d over q, k, v with SiLU, L2-normed q
  and k, the chunked gated delta rule, an RMSNorm over each value head whose output is
  multiplied by SiLU(z), and the output projection;
- a full-attention layer (0) is megatron-core's attention with `attention_output_gate`: the
  QKV projection also yields a gate per head and the attention output is multiplied by its
  sigmoid; q/k RMSNorms per head; RoPE over the first `rotary_percent` of each head's channels
  (Qwen3.5's interleaved multimodal RoPE gives every text token the same position in its three
  sections, which is plain RoPE);
- every RMSNorm but the DeltaNet's output norm scales by (1 + weight) (`norm_zero_centered`):
  `ZeroCenteredRMSNorm`, HF's Qwen3_5RMSNorm step for step, so weights convert as stored.
- MLP: SwiGLU, or (qwen3_5_moe) routed experts plus a shared expert whose output is scaled by
  sigmoid of its own gate (megatron-core's `moe_shared_expert_gate`).

megatron-core's experimental block spec for these layers (get_transformer_block_with_
experimental_attention_variant_spec) requires Transformer Engine; this module builds the same
per-layer structure from local modules, so it runs on CPU. On CPU the DeltaNet's kernels are
megatron-core's torch paths (`deterministic_mode`: nn.Conv1d and torch_chunk_gated_delta_rule,
the algorithm of transformers' torch_chunk_gated_delta_rule; both run the rule in float32
whatever the model's dtype) with cpu_compat shim 7 standing in for the absent
flash-linear-attention package's l2norm. Context parallelism: on CPU the model sees whole
sequences (cp_mode "loss"), so the DeltaNet needs none; on GPUs (cp_mode "model") megatron-core
0.19.2's GatedDeltaNet splits its heads over CP with all-to-alls (ParallelLayout asks tp x cp to
divide them), 0.16.1's refuses cp > 1 itself when its config is built. Not run on a GPU here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored as an offset from 1: x / rms(x) * (1 + weight), computed in
    float32 as transformers' Qwen3_5RMSNorm does (HF stores these weights so; conversion copies
    them). Built by megatron-core's build_module with (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if getattr(config, "sequence_parallel", False):
            # Under SP a norm sees this TP rank's slice of the sequence: its gradient is summed
            # over TP by megatron-core's finalize_model_grads (as for its own norms).
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class HeadSharedRMSNorm(torch.nn.Module):
    """The Gated DeltaNet's output RMSNorm: over each value head's channels, one weight shared
    by all heads, applied as transformers' Qwen3_5RMSNormGated does before its gate (normalise
    in float32, back to the input's dtype, times the weight).

    Under tensor parallelism each rank holds some of the heads, so the weight's gradient on a
    rank is its heads' share; the full gradient is their sum. megatron-core's finalize_model_grads
    sums a replicated weight over TP only for sequence-parallel norms and q/k layernorms (by
    name), so with megatron-core's own norm here the TP ranks keep different partial gradients
    (measured with `megatron-ba check-layout --model tiny-qwen3.5 --tp 2`: 0.65-1.0 relative
    error on every DeltaNet out_norm). This norm uses its weight through megatron-core's
    copy-to-TP-region (identity forward, all-reduce of the gradient over TP backward), so the
    gradient is the full one on every rank, with or without sequence parallelism.
    `sum_grad_over_tp` False is the layout check's negative control (megatron-core's behaviour)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.sum_grad_over_tp = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        weight = self.weight
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.sum_grad_over_tp and tp > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            weight = copy_to_tensor_model_parallel_region(weight, group=group)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype)


def hybrid_config_fields(spec) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3.5 spec (nothing for a model without its features)."""
    fields: dict[str, Any] = {}
    if spec.attention_output_gate:
        fields["attention_output_gate"] = True
    if spec.has_linear_attention:
        fields.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=list(spec.linear_attention_pattern),
            linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
            linear_key_head_dim=spec.linear_key_head_dim,
            linear_value_head_dim=spec.linear_value_head_dim,
            linear_num_key_heads=spec.linear_num_key_heads,
            linear_num_value_heads=spec.linear_num_value_heads,
        )
    if spec.num_experts and spec.shared_expert_ffn_hidden_size:
        fields.update(
            moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=True,
        )
    return fields


def is_hybrid(spec) -> bool:
    """Whether `spec` needs this module's block spec (any Qwen3.5 feature)."""
    return bool(spec.has_linear_attention or spec.attention_output_gate or spec.norm_zero_centered)


def hybrid_block_spec(config, spec, vp_stage: int | None = None):
    """megatron-core TransformerBlockSubmodules for this rank's pipeline stage of `spec` (its
    layers as megatron-core's offset and count give them, uneven stages included), local
    modules. A block spec lists only the stage's layers: GPTModel builds every layer it gets."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    norm = ZeroCenteredRMSNorm if spec.norm_zero_centered else _torch_rms_norm()
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [_layer_spec(config, spec, i, norm) for i in range(first, first + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def _layer_spec(config, spec, index: int, norm):
    """Layer `index`: the local spec of its MLP kind, its norms replaced by `norm`, its
    attention by a Gated DeltaNet when the pattern says so."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = spec.is_moe_layer(index)
    layer = copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=spec.num_experts if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=spec.qk_layernorm,
            normalization="RMSNorm",
        )
    )
    sub = layer.submodules
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    if spec.is_linear_attention_layer(index):
        sub.self_attention = _gated_delta_net_spec()
    elif spec.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = norm
        sub.self_attention.submodules.k_layernorm = norm
    return layer


def _gated_delta_net_spec():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            # HF's gated output norm is a plain RMSNorm (weight initialised to 1, not offset)
            out_norm=HeadSharedRMSNorm,
            out_proj=RowParallelLinear,
        ),
    )


def mark_tp_sections(model: torch.nn.Module) -> None:
    """Mark the Gated DeltaNet's fused weights with the full sizes of their parts
    (`partition_sections`, read by megatron_ba.parallel.full_shape.tp_sharding): megatron-core
    shards in_proj as one ColumnParallelLinear, so rank r holds rows [q_r; k_r; v_r; z_r; beta_r;
    alpha_r] (its forward splits them so; its sharded_state_dict cuts the same parts), and the
    conv1d's channels as [q_r; k_r; v_r]. A plain contiguous split of the full [q; k; v; z; beta;
    alpha] would give rank 0 all of q and part of k."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            qk, v, nv = module.qk_dim, module.v_dim, module.num_value_heads
            module.in_proj.weight.partition_sections = (qk, qk, v, v, nv, nv)
            module.conv1d.weight.partition_sections = (qk, qk, v)


def _torch_rms_norm():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm
