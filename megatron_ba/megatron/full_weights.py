"""Full-shape (TP=1, PP=1) weights of megatron_ba.megatron.model's GPTModel: every parameter's
name and shape (full_parameter_shapes, megatron-core's local-spec names with global layer
numbers and its fused layouts) and their deterministic initial values (full_init_state_dict),
which parallel.full_shape loads into a rank's shards and the layout check starts both sides
from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_ba.megatron.model import ModelSpec


def full_parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the unsharded (TP=1, PP=1) model (local-spec names;
    a tied model has no `output_layer.weight`)."""
    h, f, v = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if spec.is_linear_attention_layer(i):
            shapes.update(_gated_delta_net_shapes(spec, p + "self_attention."))
        else:
            shapes.update(_attention_shapes(spec, p + "self_attention."))
        shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if spec.is_moe_layer(i):
            shapes.update(_moe_shapes(spec, p + "mlp."))
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, f)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (v, h)
    return shapes


def _attention_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """Full attention: the fused QKV (with a gate per query head when `attention_output_gate`),
    its optional bias, the output projection and the q/k norms."""
    h, d, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    qkv = (heads * (2 if spec.attention_output_gate else 1) + 2 * spec.num_query_groups) * d
    shapes = {prefix + "linear_qkv.weight": (qkv, h)}
    if spec.qkv_bias:
        shapes[prefix + "linear_qkv.bias"] = (qkv,)
    shapes[prefix + "linear_proj.weight"] = (h, heads * d)
    if spec.qk_layernorm:  # one RMSNorm weight over each head's channels, shared by heads
        shapes[prefix + "q_layernorm.weight"] = (d,)
        shapes[prefix + "k_layernorm.weight"] = (d,)
    return shapes


def _gated_delta_net_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """megatron-core's GatedDeltaNet: in_proj rows [q; k; v; z; beta; alpha], the depthwise
    conv1d over [q; k; v], per-value-head dt_bias and A_log, the per-head output norm and
    out_proj."""
    h = spec.hidden_size
    qk = spec.linear_num_key_heads * spec.linear_key_head_dim
    v = spec.linear_num_value_heads * spec.linear_value_head_dim
    nv = spec.linear_num_value_heads
    return {
        prefix + "in_proj.weight": (2 * qk + 2 * v + 2 * nv, h),
        prefix + "conv1d.weight": (2 * qk + v, 1, spec.linear_conv_kernel_dim),
        prefix + "dt_bias": (nv,),
        prefix + "A_log": (nv,),
        prefix + "out_norm.weight": (spec.linear_value_head_dim,),
        prefix + "out_proj.weight": (h, v),
    }


def _moe_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router, SequentialMLP experts (global expert numbers) and shared expert
    with its gate (Qwen3.5)."""
    h, f = spec.hidden_size, spec.moe_ffn_hidden_size
    shapes = {prefix + "router.weight": (spec.num_experts, h)}
    fs = spec.shared_expert_ffn_hidden_size
    if fs:
        shapes[prefix + "shared_experts.linear_fc1.weight"] = (2 * fs, h)
        shapes[prefix + "shared_experts.linear_fc2.weight"] = (h, fs)
        shapes[prefix + "shared_experts.gate_weight"] = (1, h)
    for j in range(spec.num_experts):
        e = f"{prefix}experts.local_experts.{j}."
        shapes[e + "linear_fc1.weight"] = (2 * f, h)
        shapes[e + "linear_fc2.weight"] = (h, f)
    return shapes


def full_init_state_dict(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full-shape weights: N(0, init_std) matrices, norms near 1, small biases.

    Norm weights and biases are perturbed (not 1 / 0) so that a gradient check sees every
    parameter's gradient path, including the ones a constant initialisation would hide.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in full_parameter_shapes(spec).items():
        if name.endswith("layernorm.weight"):
            # a zero-centred norm scales by 1 + weight (Qwen3.5): its weight is near 0
            t = float(not spec.norm_zero_centered) + 0.1 * torch.randn(
                shape, generator=g, dtype=torch.float64
            )
        elif name.endswith("out_norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name.endswith((".A_log", ".dt_bias")):
            # DeltaNet decay: A = exp(A_log) in about [1, 16] as megatron-core draws it
            t = torch.empty(shape, dtype=torch.float64).uniform_(0.0, 2.7, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            t = spec.init_std * torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = t.to(spec.params_dtype)
    return out
