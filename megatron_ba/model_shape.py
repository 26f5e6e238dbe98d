"""The shape of a Qwen-family decoder, its parameter and activation counts, and the named shapes
every part of the project uses.

    shape = PRESETS["Qwen2.5-Math-7B"]          # or preset("qwen2.5-math-7b"), case-insensitive
    shape.total_params(), shape.head_dim       # a layout against it: parallel_layout
    spec = ModelSpec.of(PRESETS["debug"])       # megatron_ba.megatron.model: + build options

Pure Python (no torch), so the recipe, the planner, the benchmarks' argument parsers and
scripts/gpu_check.py read it without importing torch. The model builder
(megatron_ba.megatron.model.ModelSpec) extends it with what only a build needs (parameter dtype,
initialisation, megatron-core config overrides); the planner (megatron_ba.planning) computes
memory and FLOPs from it.

The architecture is Qwen2's or Qwen3's: RMSNorm, SwiGLU MLP without biases, RoPE (plain or
scaled by YaRN: `rope_scaling`), grouped-query
attention with a bias on the fused QKV projection (Qwen2) or RMSNorms on each q and k head (Qwen3,
`qk_layernorm`), an explicit head dimension (`kv_channels`), tied or untied output layer. Field
names follow megatron-core where they overlap (Hugging Face's num_key_value_heads is
num_query_groups, intermediate_size is ffn_hidden_size, head_dim is kv_channels). Qwen3.5's
hybrid decoder (Gated DeltaNet layers between gated full-attention layers) is described by the
fields below; the counts take each layer by its type (`total_params` equals transformers'
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM parameter count: tests/test_planner_qwen3_5.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ba.rope_scaling import RopeScaling, coerce, rope_scaling_from_hf

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
        ConditionalGeneration layout keeps its text model under `text_config`)."""
        if _is_qwen3_5(cfg):
            return _qwen3_5_from_hf_config(cfg, name)
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [k for k in (*need, "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"--model {name}: config.json lacks {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        qwen3 = str(cfg.get("model_type", "")).startswith("qwen3")
        experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
        if experts and not cfg.get("moe_intermediate_size"):
            raise ValueError(
                f"--model {name}: config.json has experts but no moe_intermediate_size"
            )
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(
                cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 1e6
            ),
            rope_scaling=_rope_scaling_or_none(cfg, name),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(cfg.get("attention_bias", not qwen3)),
            family=_family(cfg, qwen3),
            qk_layernorm=qwen3,
            kv_channels=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
            moe_router_topk=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            shared_expert_ffn_hidden_size=_shared_ffn(cfg) if experts else 0,
            name=name,
        )

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
        (the experts' input) and as returned (before the weighted sum), and per copy the
        expert's gate, up and SwiGLU outputs; the shared expert as a dense MLP."""
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
        return 4 * h + mixer + self.num_experts + k * (2 * h + 3 * fe) + 3 * fs

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


QWEN3_5_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}


def _is_qwen3_5(cfg: dict) -> bool:
    return str(cfg.get("model_type")) in QWEN3_5_MODEL_TYPES


def qwen3_5_text_config(cfg: dict) -> dict:
    """The text model's fields of a Qwen3.5 config.json: its `text_config` when nested (the
    ConditionalGeneration layout), else the config itself; a top-level tie_word_embeddings
    applies to the text model (the multimodal configs keep it there)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    merged = dict(text)
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def qwen3_5_layer_pattern(text: dict, num_layers: int, where: str) -> tuple[int, ...]:
    """1 (linear_attention) / 0 (full_attention) per layer, from `layer_types` or, as
    transformers derives it, from `full_attention_interval` (every n-th layer full)."""
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        return tuple(int(bool((i + 1) % interval)) for i in range(num_layers))
    known = {"linear_attention": 1, "full_attention": 0}
    unknown = sorted({str(t) for t in layer_types} - set(known))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"{where}: layer_types must hold {num_layers} entries of {sorted(known)}; got "
            f"{len(layer_types)} entries{f', unknown {unknown}' if unknown else ''}"
        )
    return tuple(known[t] for t in layer_types)


def _qwen3_5_from_hf_config(cfg: dict, name: str) -> ModelShape:
    where = f"--model {name}"
    family = QWEN3_5_MODEL_TYPES[str(cfg["model_type"])]
    text = qwen3_5_text_config(cfg)
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
    missing = [k for k in need if k not in text]
    if missing:
        raise ValueError(f"{where}: the text config lacks {', '.join(missing)}")
    rope = text.get("rope_parameters") or {}
    layers = int(text["num_hidden_layers"])
    experts = int(text.get("num_experts") or 0) if family == "qwen3_5_moe" else 0
    moe_ffn = int(text.get("moe_intermediate_size") or 0) if experts else 0
    return ModelShape(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=layers,
        num_attention_heads=int(text["num_attention_heads"]),
        num_query_groups=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
        # the MoE text config has no dense MLP (every layer routes): its width is unused
        ffn_hidden_size=int(text.get("intermediate_size") or moe_ffn),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or 1e7),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(text.get("attention_bias", False)),
        family=family,
        qk_layernorm=True,
        kv_channels=int(text["head_dim"]),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        name=name,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=int(text.get("num_experts_per_tok") or 0) if experts else 0,
        shared_expert_ffn_hidden_size=_shared_ffn(text) if experts else 0,
        moe_norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        # transformers' default when the config leaves it out (the published ones do)
        moe_aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.001)) if experts else 0.0,
        linear_attention_pattern=qwen3_5_layer_pattern(text, layers, where),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        attention_output_gate=bool(text.get("attn_output_gate", True)),
        rotary_percent=float(
            rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25
        ),
        norm_zero_centered=True,
        mtp_num_layers=int(text.get("mtp_num_hidden_layers") or 0),
    )


def _rope_scaling_or_none(cfg: dict, name: str) -> RopeScaling | None:
    """The config's YaRN for the planner's context check; None for plain RoPE and for rope types
    the megatron model does not build (llama3, DeepSeek's YaRN with mscale, ...): their shape and
    memory are still estimated, without a context check (the model build refuses them by key)."""
    try:
        return rope_scaling_from_hf(cfg, f"--model {name}")
    except ValueError:
        return None


def _shared_ffn(cfg: dict) -> int:
    """The shared expert's width: Qwen2-MoE's shared_expert_intermediate_size, or DeepSeek's
    n_shared_experts x moe_intermediate_size."""
    if cfg.get("shared_expert_intermediate_size"):
        return int(cfg["shared_expert_intermediate_size"])
    return int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_intermediate_size") or 0)


def _family(cfg: dict, qwen3: bool) -> str:
    if cfg.get("model_type") == "qwen3_moe":
        return "qwen3_moe"
    return "qwen3" if qwen3 else "qwen2"


def _qwen3(name: str, **fields) -> ModelShape:
    defaults = {"family": "qwen3", "qkv_bias": False, "qk_layernorm": True}
    return ModelShape(name=name, **{**defaults, **fields})


# What the published Qwen3.5 text configs share (each config.json's `text_config`): vocabulary
# 248320, head_dim 256, a Gated DeltaNet of 16 key heads of 128 and value heads of 128 with a
# convolution of 4, full attention every 4th layer (full_attention_interval 4; layer_types
# spells the same), attn_output_gate true, rope_theta 10000000 with partial_rotary_factor 0.25,
# rms_norm_eps 1e-06, max_position_embeddings 262144, untied, one MTP layer
# (mtp_num_hidden_layers 1, not counted: ModelShape.total_params), mamba_ssm_dtype float32 (the
# engine's recurrent state: planning/generation_memory.py).
def _qwen3_5(name: str, num_layers: int, **fields) -> ModelShape:
    shared = dict(
        vocab_size=248320,
        max_position_embeddings=262144,
        rope_theta=10_000_000.0,
        qkv_bias=False,
        qk_layernorm=True,
        kv_channels=256,
        linear_attention_pattern=tuple(int(bool((i + 1) % 4)) for i in range(num_layers)),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        attention_output_gate=True,
        rotary_percent=0.25,
        norm_zero_centered=True,
        mtp_num_layers=1,
    )
    return ModelShape(name=name, num_layers=num_layers, **{**shared, **fields})


# The tiny Qwen3.5 presets' shared fields (see "tiny-qwen3.5" below).
_TINY_QWEN3_5 = dict(
    vocab_size=512,
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=256,
    max_position_embeddings=1024,
    rope_theta=10_000_000.0,
    qkv_bias=False,
    qk_layernorm=True,
    kv_channels=32,
    linear_attention_pattern=(1, 1, 1, 0),
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    attention_output_gate=True,
    rotary_percent=0.25,
    norm_zero_centered=True,
)


PRESETS: dict[str, ModelShape] = {
    # The paper's models (and two the planner is compared with in docs/cluster-planning.md): the
    # values of each model's public config.json on the Hugging Face hub that the planner reads;
    # max_position_embeddings, rope_theta and norm_eps are left at the defaults.
    "Qwen2.5-Math-7B": ModelShape(152064, 3584, 28, 28, 4, 18944, name="Qwen2.5-Math-7B"),
    "Qwen3-1.7B": _qwen3(
        "Qwen3-1.7B",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=6144,
        kv_channels=128,
        tie_word_embeddings=True,
    ),
    # Not a model of the paper's recipes: the shape of NeMo-RL's Qwen3-32B recipe, which
    # docs/cluster-planning.md compares the planner with.
    "Qwen3-32B": _qwen3(
        "Qwen3-32B",
        vocab_size=151936,
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=25600,
        kv_channels=128,
    ),
    "Qwen2.5-32B": ModelShape(152064, 5120, 64, 40, 8, 27648, name="Qwen2.5-32B"),
    # The models of the public runs the planner is checked against (tests/fixtures/
    # public_runs.json; docs/cluster-planning.md), from each config.json on the hub. The -Instruct
    # and -Base variants have the same shape.
    "Qwen2.5-7B": ModelShape(152064, 3584, 28, 28, 4, 18944, name="Qwen2.5-7B"),
    "Qwen2.5-14B": ModelShape(152064, 5120, 48, 40, 8, 13824, name="Qwen2.5-14B"),
    "Qwen2.5-72B": ModelShape(152064, 8192, 80, 64, 8, 29568, name="Qwen2.5-72B"),
    "Qwen3-4B": _qwen3(
        "Qwen3-4B",
        vocab_size=151936,
        hidden_size=2560,
        num_layers=36,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=9728,
        kv_channels=128,
        tie_word_embeddings=True,
    ),
    "Qwen3-30B-A3B": _qwen3(
        "Qwen3-30B-A3B",
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        ffn_hidden_size=6144,
        kv_channels=128,
        num_experts=128,
        moe_ffn_hidden_size=768,
        moe_router_topk=8,
    ),
    "Qwen3-235B-A22B": _qwen3(
        "Qwen3-235B-A22B",
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_attention_heads=64,
        num_query_groups=4,
        ffn_hidden_size=12288,
        kv_channels=128,
        num_experts=128,
        moe_ffn_hidden_size=1536,
        moe_router_topk=8,
    ),
    # The models of the second validation set (tests/fixtures/validation_runs.json) that the
    # record lacks, from each config.json as published (copies that keep the hub's
    # `_name_or_path`). Llama is read as from_hf_config reads a `llama` config: grouped-query
    # attention without biases, untied, family "qwen2" (the conversion table's name only); its
    # llama3 RoPE scaling changes no memory term and is left out (no context check).
    # meta-llama/Llama-3.1-8B-Instruct (_name_or_path of e.g. huggingface.co/NaniDAO/
    # Meta-Llama-3.1-8B-Instruct-ablated config.json): hidden 4096, 32 layers, 32 heads, 8 KV
    # heads, intermediate 14336, vocab 128256, rope_theta 500000, rms_norm_eps 1e-05, untied.
    "Llama-3.1-8B": ModelShape(
        128256,
        4096,
        32,
        32,
        8,
        14336,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        qkv_bias=False,
        name="Llama-3.1-8B",
    ),
    # meta-llama/Llama-3.3-70B-Instruct (_name_or_path of huggingface.co/relaxml/
    # Llama-3.3-70B-Instruct-QTIP-3Bit config.json): hidden 8192, 80 layers, 64 heads, 8 KV
    # heads, intermediate 28672, vocab 128256, rope_theta 500000, rms_norm_eps 1e-05, untied.
    "Llama-3.3-70B": ModelShape(
        128256,
        8192,
        80,
        64,
        8,
        28672,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        qkv_bias=False,
        name="Llama-3.3-70B",
    ),
    # Qwen/Qwen1.5-MoE-A2.7B (qwen2_moe; _name_or_path of huggingface.co/MaziyarPanahi/
    # Qwen1.5-MoE-A2.7B-Wikihow config.json): hidden 2048, 24 layers, 16 heads, 16 KV heads,
    # intermediate 5632, 60 experts of moe_intermediate_size 1408, top 4 (norm_topk_prob false),
    # a shared expert of shared_expert_intermediate_size 5632 with its sigmoid gate (counted by
    # the planner; the model build refuses it), decoder_sparse_step 1 (every layer MoE), vocab
    # 151936, untied, QKV bias (Qwen2).
    "Qwen1.5-MoE-A2.7B": ModelShape(
        151936,
        2048,
        24,
        16,
        16,
        5632,
        name="Qwen1.5-MoE-A2.7B",
        num_experts=60,
        moe_router_topk=4,
        moe_ffn_hidden_size=1408,
        shared_expert_ffn_hidden_size=5632,
        moe_norm_topk_prob=False,
    ),
    # Qwen3.5 (hybrid Gated DeltaNet and gated full attention; `text_config` of each
    # config.json on the hub, the shared values in _qwen3_5 above). No copy of the hub's files is
    # vendored here: the values were read from public copies that quote each config.json (its
    # revision where they give one), and cross-checked against the megatron-core arguments of
    # THUDM/slime's scripts/models/qwen3.5-{27B,35B-A3B,397B-A17B}.sh; each preset's total_params
    # is checked against the size its name gives (tests/test_planner_qwen3_5.py).
    # https://huggingface.co/Qwen/Qwen3.5-9B/blob/main/config.json (revision c2022362): hidden
    # 4096, 32 layers, 16 heads, 4 KV heads, intermediate 12288, 32 DeltaNet value heads.
    "Qwen3.5-9B": _qwen3_5(
        "Qwen3.5-9B",
        32,
        family="qwen3_5",
        hidden_size=4096,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=12288,
        linear_num_value_heads=32,
    ),
    # https://huggingface.co/Qwen/Qwen3.5-27B/blob/main/config.json (revision fc05daec, the one
    # NVIDIA-NeMo/Megatron-Bridge's src/megatron/bridge/recipes/qwen/h100/qwen35.py pins): hidden
    # 5120, 64 layers, 24 heads, 4 KV heads, intermediate 17408, 48 DeltaNet value heads
    # (THUDM/slime scripts/models/qwen3.5-27B.sh gives the same attention and MLP sizes).
    "Qwen3.5-27B": _qwen3_5(
        "Qwen3.5-27B",
        64,
        family="qwen3_5",
        hidden_size=5120,
        num_attention_heads=24,
        num_query_groups=4,
        ffn_hidden_size=17408,
        linear_num_value_heads=48,
    ),
    # https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json (revision 59d61f3c):
    # hidden 2048, 40 layers, 16 heads, 2 KV heads, 32 DeltaNet value heads, 256 experts of
    # moe_intermediate_size 512, top 8, a gated shared expert of shared_expert_intermediate_size
    # 512 in every layer; no dense MLP (its ffn_hidden_size, unused, is the expert width).
    # THUDM/slime scripts/models/qwen3.5-35B-A3B.sh gives the same values.
    "Qwen3.5-35B-A3B": _qwen3_5(
        "Qwen3.5-35B-A3B",
        40,
        family="qwen3_5_moe",
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=2,
        ffn_hidden_size=512,
        linear_num_value_heads=32,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=512,
        shared_expert_ffn_hidden_size=512,
    ),
    # https://huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json: hidden 4096, 60
    # layers, 32 heads, 2 KV heads, 64 DeltaNet value heads, 512 experts of
    # moe_intermediate_size 1024, top 10, a gated shared expert of 1024 (THUDM/slime
    # scripts/models/qwen3.5-397B-A17B.sh: --moe-shared-expert-intermediate-size 1024).
    "Qwen3.5-397B-A17B": _qwen3_5(
        "Qwen3.5-397B-A17B",
        60,
        family="qwen3_5_moe",
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=2,
        ffn_hidden_size=1024,
        linear_num_value_heads=64,
        num_experts=512,
        moe_router_topk=10,
        moe_ffn_hidden_size=1024,
        shared_expert_ffn_hidden_size=1024,
    ),
    # The benchmarks' and the GPU check's real-sized shapes, from the public config.json
    # (Qwen2.5-0.5B and -1.5B tie the output layer to the embedding).
    "qwen2.5-0.5b": ModelShape(
        151936,
        896,
        24,
        14,
        2,
        4864,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        name="qwen2.5-0.5b",
    ),
    "qwen2.5-1.5b": ModelShape(
        151936, 1536, 28, 12, 2, 8960, tie_word_embeddings=True, name="qwen2.5-1.5b"
    ),
    # CPU-sized shapes of the same family. tiny: the CPU recipes' policy (recipe.TINY_SHAPE;
    # the recipe's vocabulary is its tokenizer's) and the benchmarks' default.
    "tiny": ModelShape(
        1024, 128, 2, 4, 2, 384, max_position_embeddings=256, rope_theta=10_000.0, name="tiny"
    ),
    "small": ModelShape(32768, 512, 8, 8, 2, 1408, name="small"),
    # The model of the multi-process CPU tests and the layout check (~60k parameters): head_dim
    # 16, 4 query heads in 2 groups (TP=2 splits both), 4 layers (PP=2 or 4 splits them).
    "debug": ModelShape(
        128, 64, 4, 4, 2, 96, max_position_embeddings=256, rope_theta=10_000.0, name="debug"
    ),
    # Hugging Face tiny models (megatron_ba.testing.tiny_hf; `megatron-ba tiny-model`): tied,
    # head_dim 32 (the smallest vLLM's CPU attention takes); the vocabulary is the tokenizer's.
    "tiny-qwen2": ModelShape(512, 128, 2, 4, 2, 256, tie_word_embeddings=True, name="tiny-qwen2"),
    "tiny-qwen3": _qwen3(
        "tiny-qwen3",
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        max_position_embeddings=1024,
        kv_channels=32,
        tie_word_embeddings=True,
    ),
    # A CPU Qwen3-MoE (megatron_ba.testing.tiny_hf.build_tiny_qwen3_moe; `megatron-ba tiny-model
    # --family qwen3_moe`): 8 experts, top-2, head_dim 32 for vLLM's CPU attention.
    "tiny-moe": _qwen3(
        "tiny-moe",
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        max_position_embeddings=1024,
        kv_channels=32,
        tie_word_embeddings=True,
        family="qwen3_moe",
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_aux_loss_coeff=0.001,
    ),
    # CPU-sized Qwen3.5 (megatron_ba.testing.tiny_hf; `megatron-ba tiny-model --family qwen3_5`,
    # `--family qwen3_5_moe`): 4 layers, 3 Gated DeltaNet then 1 full attention (Qwen3.5's
    # every-4th pattern; PP2 splits it 2 + 2), head_dim 32 for vLLM's CPU attention with a
    # quarter of it rotated, 2 key and 4 value heads of 64 channels in the DeltaNet (TP2 splits
    # both; vLLM's CPU delta-rule kernel takes head dims 64 and 128 only), untied (a tied model
    # cannot run PP > 1 on CPU: megatron_ba.megatron.model.build_gpt_model).
    "tiny-qwen3.5": ModelShape(
        name="tiny-qwen3.5",
        family="qwen3_5",
        **_TINY_QWEN3_5,
    ),
    # Its mixture of experts: 8 routed experts, top-2, and a gated shared expert in every layer.
    "tiny-qwen3.5-moe": ModelShape(
        name="tiny-qwen3.5-moe",
        family="qwen3_5_moe",
        **{**_TINY_QWEN3_5, "ffn_hidden_size": 64},
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        shared_expert_ffn_hidden_size=64,
        moe_aux_loss_coeff=0.001,
    ),
}


def preset(name: str) -> ModelShape:
    """A preset by name (case-insensitive; a hub id's `Qwen/` prefix is ignored)."""
    key = name.split("/")[-1].lower()
    for suffix in ("", "-instruct", "-base"):
        for preset_name, shape in PRESETS.items():
            if preset_name.lower() + suffix == key:
                return shape
    raise KeyError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
