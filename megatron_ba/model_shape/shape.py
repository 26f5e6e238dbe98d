"""ModelShape: a Qwen-family decoder's shape and its parameter and activation counts.

The package's front page (megatron_ba/model_shape/__init__.py) says what the shape describes;
config.json is read in config_json.py, the named shapes are in presets.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ba.model_shape.config_json import shape_fields
from megatron_ba.rope_scaling import RopeScaling, coerce

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 / Qwen3 decoder's shape.

    family: "qwen2" (Qwen2 / Qwen2.5: QKV bias) or "qwen3" (q/k RMSNorm, no QKV bias); it names
    the Hugging Face conversion table and does not change the build: the flags do. kv_channels:
    the head dimension when it is not hidden / heads (Qwen3); None means hidden_size //
    num_attention_heads. tie_word_embeddings: the output layer reuses the embedding.
    rope_scaling: None (plain RoPE) or megatron_ba.rope_scaling.RopeScaling (YaRN; a dict of its
    fields is read as one); it changes no parameter or memory count, only `max_context`. name: a
    label (a preset's name, a config.json's path); it takes no part in comparisons.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    family: str = "qwen2"
    qk_layernorm: bool = False
    kv_channels: int | None = None
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    name: str = field(default="model", compare=False)
    # Mixture of experts (0 experts: dense). A MoE layer's MLP is a router over `num_experts`
    # SwiGLU experts of `moe_ffn_hidden_size`, `moe_router_topk` per token, plus a shared expert
    # of `shared_expert_ffn_hidden_size` (0: none; Qwen2-MoE has one, Qwen3-MoE not; the planner
    # counts it, the model build refuses it). moe_layer_pattern: 1 (MoE) or 0 (dense MLP of
    # ffn_hidden_size) per layer, None: every layer MoE. moe_norm_topk_prob: the top-k routing
    # weights are renormalised to sum to 1 (HF norm_topk_prob).
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_layer_pattern: tuple[int, ...] | None = None
    moe_aux_loss_coeff: float = 0.0
    # Qwen3.5's hybrid decoder. linear_attention_pattern: 1 (a Gated DeltaNet layer: causal
    # conv1d of kernel linear_conv_kernel_dim over q, k, v, then the gated delta rule with
    # linear_num_key_heads key heads of linear_key_head_dim and linear_num_value_heads value
    # heads of linear_value_head_dim, a gated RMSNorm on its output) or 0 (full attention) per
    # layer; None: every layer full attention. attention_output_gate: the full-attention output
    # is multiplied by sigmoid of a per-head gate that the q projection also produces.
    # rotary_percent: the fraction of each head's channels that RoPE rotates (HF
    # partial_rotary_factor). norm_zero_centered: every RMSNorm but the DeltaNet output's scales
    # by (1 + weight) (HF Qwen3.5's weights are stored so). mtp_num_layers: the checkpoint's
    # multi-token-prediction layers (carried through conversion unchanged; not trained).
    linear_attention_pattern: tuple[int, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attention_output_gate: bool = False
    rotary_percent: float = 1.0
    norm_zero_centered: bool = False
    mtp_num_layers: int = 0

    def __post_init__(self) -> None:
        for key in _POSITIVE:
            v = getattr(self, key)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{key}: must be an integer >= 1, got {v!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family: must be one of {FAMILIES}, got {self.family!r}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size: {self.hidden_size} must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads}), or set kv_channels (the head dimension)"
                )
        elif not (isinstance(self.kv_channels, int) and self.kv_channels >= 1):
            raise ValueError(
                f"kv_channels: must be an integer >= 1 or None, got {self.kv_channels!r}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        object.__setattr__(self, "rope_scaling", coerce(self.rope_scaling))
        if self.moe_layer_pattern is not None:  # a JSON list read back from a checkpoint
            object.__setattr__(self, "moe_layer_pattern", tuple(self.moe_layer_pattern))
        if self.num_experts:
            self._check_moe()
        if self.linear_attention_pattern is not None:
            object.__setattr__(
                self, "linear_attention_pattern", tuple(self.linear_attention_pattern)
            )
            self._check_linear_attention()
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent: must be in (0, 1], got {self.rotary_percent!r}")

    def _check_linear_attention(self) -> None:
        pattern = self.linear_attention_pattern
        if len(pattern) != self.num_layers or set(pattern) - {0, 1}:
            raise ValueError(
                f"linear_attention_pattern: one 1 (Gated DeltaNet) or 0 (full attention) per "
                f"layer ({self.num_layers}); got {pattern}"
            )
        for key in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            v = getattr(self, key)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{key}: must be an integer >= 1 with linear attention, got {v!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_key_heads: {self.linear_num_key_heads} must divide "
                f"linear_num_value_heads ({self.linear_num_value_heads})"
            )

    def is_linear_attention_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a Gated DeltaNet layer instead of full attention."""
        pattern = self.linear_attention_pattern
        return pattern is not None and pattern[index] == 1

    @property
    def has_linear_attention(self) -> bool:
        return self.linear_attention_pattern is not None and 1 in self.linear_attention_pattern

    def _check_moe(self) -> None:
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"moe_router_topk: must be in [1, num_experts={self.num_experts}], "
                f"got {self.moe_router_topk}"
            )
        if not (isinstance(self.moe_ffn_hidden_size, int) and self.moe_ffn_hidden_size >= 1):
            raise ValueError(
                f"moe_ffn_hidden_size: must be an integer >= 1, got {self.moe_ffn_hidden_size!r}"
            )
        pattern = self.moe_layer_pattern
        if pattern is not None and (
            len(pattern) != self.num_layers or set(pattern) - {0, 1} or 1 not in pattern
        ):
            raise ValueError(
                f"moe_layer_pattern: one 0 (dense) or 1 (MoE) per layer ({self.num_layers}), "
                f"at least one 1; got {pattern}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has experts instead of a dense MLP."""
        if not self.num_experts:
            return False
        return self.moe_layer_pattern is None or self.moe_layer_pattern[index] == 1

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "model") -> ModelShape:
        """The shape of a Hugging Face Qwen2 / Qwen3 / Qwen3.5 config.json (a dict; Qwen3.5's
        ConditionalGeneration layout keeps its text model under `text_config`), read by
        megatron_ba.model_shape.config_json."""
        return cls(**shape_fields(cfg, name))

    @property
    def max_context(self) -> int:
        """The longest sequence the position embedding is made for: max_position_embeddings, or
        with YaRN factor x original_max_position_embeddings when that is longer."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return max(self.max_position_embeddings, self.rope_scaling.max_context)

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # -- parameter counts -------------------------------------------------------------------
    # Per layer, by its type (`index`, 0-based; None: layer 0, which is every layer of a model
    # without linear attention or a moe_layer_pattern). The multi-token-prediction layers of a
    # Qwen3.5 checkpoint (mtp_num_layers) are not trained and are counted nowhere.
    def layer_params(self, index: int | None = None) -> int:
        return self.layer_dense_params(index) + self.layer_expert_params(index)

    def layer_dense_params(self, index: int | None = None) -> int:
        """A layer's parameters outside the routed experts: its token mixer (full attention or a
        Gated DeltaNet), its two RMSNorms, the dense MLP (or, for a MoE layer, the router and
        the shared expert with its gate)."""
        i = 0 if index is None else index
        return self.mixer_params(i) + self.mlp_dense_params(i) + 2 * self.hidden_size

    def mixer_params(self, index: int = 0) -> int:
        """Layer `index`'s token mixer: full attention (attention_params) or, where
        linear_attention_pattern says so, a Gated DeltaNet (linear_attention_params)."""
        if self.is_linear_attention_layer(index):
            return self.linear_attention_params()
        return self.attention_params()

    def attention_params(self) -> int:
        """Full attention: the q, k, v, o projections (q's doubled with attention_output_gate:
        it also produces the per-head output gate), the QKV bias (Qwen2), the q / k RMSNorms of
        one head each (Qwen3, Qwen3.5)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * q * (2 if self.attention_output_gate else 1) + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_layernorm:
            attn += 2 * d
        return attn

    def linear_attention_params(self) -> int:
        """A Gated DeltaNet (Qwen3.5; megatron-core's GatedDeltaNet, transformers'
        Qwen3_5GatedDeltaNet): the input projection h x (2 Kd + 2 Vd + 2 nv) (q, k, v, the
        output gate z, beta and alpha), the depthwise causal conv1d over q, k, v ((2 Kd + Vd) x
        kernel, no bias), dt_bias and A_log (nv each), the gated RMSNorm of one value head
        (linear_value_head_dim) and the output projection Vd x h, where Kd = key heads x key head
        dim, Vd = value heads x value head dim, nv = value heads."""
        h, nv = self.hidden_size, self.linear_num_value_heads
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = nv * self.linear_value_head_dim
        in_proj = h * (2 * kd + 2 * vd + 2 * nv)
        conv = (2 * kd + vd) * self.linear_conv_kernel_dim
        return in_proj + conv + 2 * nv + self.linear_value_head_dim + vd * h

    def mlp_dense_params(self, index: int = 0) -> int:
        """Layer `index`'s MLP outside the routed experts: the dense SwiGLU (gate, up, down) or,
        for a MoE layer, the router and the shared expert with its sigmoid gate."""
        h = self.hidden_size
        if not self.is_moe_layer(index):
            return 3 * h * self.ffn_hidden_size
        fs = self.shared_expert_ffn_hidden_size
        return h * self.num_experts + (3 * h * fs + h if fs else 0)

    def layer_expert_params(self, index: int | None = None) -> int:
        """A layer's routed experts (sharded over expert parallelism): gate, up, down each; 0
        for a dense layer."""
        if not self.is_moe_layer(0 if index is None else index):
            return 0
        return self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """The output layer (0 when tied: megatron-core then shares the embedding's weight, but
        the last stage of a pipeline still holds a copy; planning.memory.stage_params counts
        it there)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def moe_mlp_params(self) -> int:
        """A MoE layer's router and experts (what replaces the dense MLP's 3 h f)."""
        h = self.hidden_size
        return self.num_experts * (h + 3 * h * self.moe_ffn_hidden_size)

    def total_params(self) -> int:
        """Every layer by its type, the embedding, the output layer (untied) and the final
        norm: the parameters a training run updates (a Qwen3.5 checkpoint's multi-token
        prediction layers and vision tower are not among them)."""
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return layers + self.embedding_params() + self.head_params() + self.hidden_size

    # -- activation elements per token per layer (bf16 tensors saved for the backward) ---------
    def layer_activation_elements(self, index: int | None = None) -> int:
        """Elements one token leaves in memory in layer `index` for the backward (None: the
        largest of the model's layers), with flash attention (no S x S scores) and no dropout
        (Qwen trains without).

        Every layer: the inputs of its two RMSNorms and of its mixer's and MLP's input
        projections (4h). Full attention: q, k and v, the attention output (the out-projection's
        input); with attention_output_gate also the gate and the gated output (2q more).
        Gated DeltaNet: linear_attention_activation_elements. Dense MLP: its gate and up
        outputs (SwiGLU's backward needs both) and SwiGLU's output (the down projection's
        input). MoE: the router's logits, each of the top-k copies of the token as dispatched
        (the experts' input), and per copy the expert's gate and up outputs and its weighted
        SwiGLU output; the shared expert as a dense MLP. megatron-core (0.16.1 and 0.19.2,
        transformer/moe/experts.py) weights each copy by its router probability inside the
        activation and its dispatchers unpermute without probs, a scatter whose backward needs
        no copy of the experts' outputs: none is kept. The activation is the fused one
        (bias_activation_fusion: weighted_bias_swiglu_impl keeps its input alone), as NeMo-RL
        and Megatron-Bridge set it; megatron-core's unfused path keeps the unweighted SwiGLU
        output too (one more expert width per copy)."""
        if index is None:
            kinds = {(self.is_linear_attention_layer(i), self.is_moe_layer(i)): i
                     for i in range(self.num_layers)}  # fmt: skip
            return max(self.layer_activation_elements(i) for i in kinds.values())
        h, d = self.hidden_size, self.head_dim
        if self.is_linear_attention_layer(index):
            mixer = self.linear_attention_activation_elements()
        else:
            q, kv = self.num_attention_heads * d, self.num_query_groups * d
            mixer = (q + 2 * kv) + q + (2 * q if self.attention_output_gate else 0)
        if not self.is_moe_layer(index):
            f = self.ffn_hidden_size
            return 4 * h + mixer + 2 * f + f
        k, fe, fs = (
            self.moe_router_topk,
            self.moe_ffn_hidden_size,
            self.shared_expert_ffn_hidden_size,
        )
        return 4 * h + mixer + self.num_experts + k * (h + 3 * fe) + 3 * fs

    def linear_attention_activation_elements(self) -> int:
        """What a Gated DeltaNet (megatron-core 0.16.1's GatedDeltaNet with FLA's
        chunk_gated_delta_rule) keeps per token for its backward, in bf16 elements, beside the
        layer's 4h: the causal conv1d's input (2 Kd + Vd, the q, k, v part of the input
        projection, copied for the convolution); the L2-normalised q and k (2 Kd); q and k
        repeated to the value heads where those outnumber the key heads (2 nv dk); v (Vd);
        the delta rule's saved within-chunk matrix A (GDN_CHUNK = 64 per value head, bf16), its
        fp32 decay g and alpha (2 each per value head) and beta (1); the delta rule's output,
        the gated norm's input (Vd); the output gate in fp32 (2 Vd); the gated norm's output,
        the output projection's input (Vd). The chunk states are recomputed in the backward
        (FLA saves q, k, v, g, beta, A; fla/ops/gated_delta_rule/chunk.py) and not counted."""
        nv, dk = self.linear_num_value_heads, self.linear_key_head_dim
        kd = self.linear_num_key_heads * dk
        vd = nv * self.linear_value_head_dim
        repeated = 2 * nv * dk if nv > self.linear_num_key_heads else 0
        conv_in, normed = 2 * kd + vd, 2 * kd
        return conv_in + normed + repeated + vd + nv * (GDN_CHUNK + 5) + vd + 2 * vd + vd


# FLA's chunk size for the gated delta rule (chunk_gated_delta_rule: chunk_size=64), the width
# of the within-chunk matrix its forward saves per value head and token.
GDN_CHUNK = 64
