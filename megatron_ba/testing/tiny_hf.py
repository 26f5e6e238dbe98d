"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5 Hugging Face models, built offline (tests,
CPU demos).

    from megatron_ba.testing.tiny_hf import build_tiny_qwen2, build_tiny_qwen3
    model_dir = build_tiny_qwen2("/tmp/tiny")     # config.json, model.safetensors, tokenizer
    model_dir = build_tiny_qwen3("/tmp/tiny3")    # or: megatron-ba tiny-model /tmp/tiny3
    model_dir = build_tiny_qwen3_moe("/tmp/moe")  # tiny-model /tmp/moe --family qwen3_moe
    model_dir = build_tiny_qwen3_5("/tmp/q35")    # tiny-model /tmp/q35 --family qwen3_5
    model_dir = build_tiny_qwen3_5_moe("/tmp/q35m", conditional=True, mtp=True)
    # vllm: LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=1024)

The tokenizer is a byte-level BPE trained here with `tokenizers` on a small built-in corpus
(math, code and prompt-template words) and wrapped as PreTrainedTokenizerFast with a ChatML
chat template, so every string can be encoded and chat templating works as with a real model.
Sizes: hidden 128 with 4 heads (head_dim 32, the smallest the vLLM CPU attention backend takes).
Nothing is downloaded.

Qwen3.5 (`build_tiny_qwen3_5`, `build_tiny_qwen3_5_moe`: the "tiny-qwen3.5" and
"tiny-qwen3.5-moe" presets) comes in either layout: `Qwen3_5ForCausalLM` (the text model alone)
or, with conditional=True, `Qwen3_5ForConditionalGeneration` as the published checkpoints are
(`model.language_model.*` beside a vision tower `model.visual.*` of one block, the smallest
vision config transformers builds). mtp=True adds a multi-token-prediction head as the
published checkpoints ship it (transformers neither builds nor loads it; names and shapes from
vLLM 0.32's qwen3_5_mtp.py, Qwen3_5MultiTokenPredictor, and public loaders' lists of the
published tensors, not from an index file read here: `mtp.fc.weight` [hidden, 2 hidden],
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight`, and
`mtp.layers.0.*`, one full-attention decoder layer named as the model's, its MoE experts one
tensor per expert), with
`mtp_num_hidden_layers: 1` and `mtp_use_dedicated_embeddings: false` in the text config.
fused_experts=True (MoE) stores the decoder's experts fused, `mlp.experts.gate_up_proj`
[E, 2 I, H] and `down_proj` [E, H, I], as the published Qwen3.5-MoE checkpoints do (transformers'
save_pretrained writes them per expert).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ba.model_shape import PRESETS
from megatron_ba.tokenization import train_bpe

# The models' default shapes ("tiny-qwen2", "tiny-qwen3", "tiny-moe", "tiny-qwen3.5",
# "tiny-qwen3.5-moe"; the vocabulary is the tokenizer's size).
TINY_QWEN2, TINY_QWEN3, TINY_MOE = PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"], PRESETS["tiny-moe"]
TINY_QWEN3_5, TINY_QWEN3_5_MOE = PRESETS["tiny-qwen3.5"], PRESETS["tiny-qwen3.5-moe"]
LAYER_TYPES = {1: "linear_attention", 0: "full_attention"}
# The smallest vision tower transformers' Qwen3.5 builds (one block; a 2 x 2 grid of position
# embeddings); its output width is the text model's hidden size.
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=1,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=4,
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "What is the sum of the roots? Find the remainder when divided by 1000. Compute the value.",
    "\\frac{1}{2} \\sqrt{3} x^2 + y^2 = 1 \\pi \\infty [0, 1) \\{1, 2, 3\\} \\cdot \\le \\ge",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 24 25 28 42 51 60 100 1024",
    "### Question: ### Format: ### Answer: Read the inputs from stdin solve the problem",
    "```python\nimport sys\na, b = map(int, input().split())\nprint(a + b)\n```",
    "class Solution:\n    def solve(self, nums: List[int]) -> int:\n        return sum(nums)\n",
    "You are an expert Python programmer. The assistant thinks, then answers the user.",
    "Therefore the answer is. So we get. Hence. Let us compute. First, second, finally.",
]


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the built-in corpus, with a ChatML template."""

    return train_bpe(
        _CORPUS * 4,
        vocab_size,
        special_tokens=SPECIAL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        split_digits=False,
        use_regex=True,
        chat_template=CHAT_TEMPLATE,
    )


def write_tokenizer(out: Path, vocab_size: int) -> dict:
    """Save the tokenizer in `out`; return its vocabulary size and token ids as config fields."""
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return dict(vocab_size=len(tokenizer), bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)


def write_generation_config(out: Path, ids: dict) -> None:
    from transformers import GenerationConfig

    ids = {k: ids[k] for k in ("eos_token_id", "pad_token_id")}
    GenerationConfig(**ids).save_pretrained(out)


def _write_tiny(out_dir: str | Path, family: str, vocab_size: int, seed: int, **shape) -> Path:
    """The tokenizer, a random model of `family` with `shape`, and a generation config."""
    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, vocab_size)
    # tied, as the small Qwen2 / Qwen3 releases
    config = config_cls(**ids, tie_word_embeddings=True, **shape)
    torch.manual_seed(seed)
    model_cls(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    write_generation_config(out, ids)
    return out


def build_tiny_qwen2(
    out_dir: str | Path,
    *,
    vocab_size: int = TINY_QWEN2.vocab_size,
    hidden_size: int = TINY_QWEN2.hidden_size,
    num_layers: int = TINY_QWEN2.num_layers,
    num_heads: int = TINY_QWEN2.num_attention_heads,
    num_kv_heads: int = TINY_QWEN2.num_query_groups,
    intermediate_size: int = TINY_QWEN2.ffn_hidden_size,
    max_position_embeddings: int = TINY_QWEN2.max_position_embeddings,
    seed: int = 0,
) -> Path:
    """Write a random Qwen2ForCausalLM and its tokenizer to `out_dir`; return the path."""
    if hidden_size % num_heads or (hidden_size // num_heads) < 32:
        raise ValueError(
            f"hidden_size / num_heads must be an integer >= 32 (vLLM CPU attention), "
            f"got {hidden_size} / {num_heads}"
        )
    return _write_tiny(
        out_dir,
        "qwen2",
        vocab_size,
        seed,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )


def build_tiny_qwen3(
    out_dir: str | Path,
    *,
    vocab_size: int = TINY_QWEN3.vocab_size,
    hidden_size: int = TINY_QWEN3.hidden_size,
    head_dim: int = TINY_QWEN3.head_dim,
    num_layers: int = TINY_QWEN3.num_layers,
    num_heads: int = TINY_QWEN3.num_attention_heads,
    num_kv_heads: int = TINY_QWEN3.num_query_groups,
    intermediate_size: int = TINY_QWEN3.ffn_hidden_size,
    max_position_embeddings: int = TINY_QWEN3.max_position_embeddings,
    seed: int = 0,
    **config,
) -> Path:
    """Write a random Qwen3ForCausalLM (q/k RMSNorm, no QKV bias, explicit head_dim, tied
    embeddings) and its tokenizer to `out_dir`; return the path. `config`: further Qwen3Config
    fields (e.g. rope_parameters with YaRN)."""
    if head_dim < 32:
        raise ValueError(f"head_dim: must be >= 32 (vLLM CPU attention), got {head_dim}")
    return _write_tiny(
        out_dir,
        "qwen3",
        vocab_size,
        seed,
        hidden_size=hidden_size,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        **config,
    )


def build_tiny_qwen3_moe(out_dir: str | Path, *, seed: int = 0, **config) -> Path:
    """Write a random Qwen3MoeForCausalLM of the "tiny-moe" shape (8 experts, top-2, renormalised
    top-k weights, every layer sparse, head_dim 32, tied) and its tokenizer to `out_dir`.

    config: Qwen3MoeConfig fields that replace the defaults (e.g. norm_topk_prob=False,
    mlp_only_layers=[0]). transformers draws the router (`mlp.gate`) like the other matrices
    (N(0, initializer_range)), so routing depends on the token."""
    shape = TINY_MOE
    fields = dict(
        hidden_size=shape.hidden_size,
        head_dim=shape.head_dim,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        max_position_embeddings=shape.max_position_embeddings,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.moe_router_topk,
        moe_intermediate_size=shape.moe_ffn_hidden_size,
        norm_topk_prob=shape.moe_norm_topk_prob,
        router_aux_loss_coef=shape.moe_aux_loss_coeff,
    )
    fields.update(config)
    if fields["head_dim"] < 32:
        raise ValueError(f"head_dim: must be >= 32 (vLLM CPU attention), got {fields['head_dim']}")
    return _write_tiny(out_dir, "qwen3_moe", shape.vocab_size, seed, **fields)


def _qwen3_5_text_config(shape, ids: dict) -> dict:
    """The text config of a Qwen3.5 `shape` (a preset), as transformers 5.19 names its fields."""
    rotary = int(shape.head_dim * shape.rotary_percent) // 2  # frequencies per head
    third = rotary // 3  # the published [11, 11, 10] split of 32, for `rotary`
    rope = dict(rope_type="default", rope_theta=shape.rope_theta)
    rope.update(partial_rotary_factor=shape.rotary_percent, mrope_interleaved=True)
    rope["mrope_section"] = [third + (rotary % 3 > 0), third + (rotary % 3 > 1), third]
    text = dict(
        **ids,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        layer_types=[LAYER_TYPES[t] for t in shape.linear_attention_pattern],
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        rope_parameters=rope,
    )
    if shape.num_experts:
        text.update(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.moe_router_topk,
            moe_intermediate_size=shape.moe_ffn_hidden_size,
            shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size,
            router_aux_loss_coef=shape.moe_aux_loss_coeff,
        )
    else:
        text["intermediate_size"] = shape.ffn_hidden_size
    return text


def _write_tiny_qwen3_5(out_dir, shape, seed: int, conditional: bool, config: dict) -> Path:
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, shape.vocab_size)
    text = {**_qwen3_5_text_config(shape, ids), **config}
    name = "Qwen3_5Moe" if shape.num_experts else "Qwen3_5"
    if conditional:
        hf_config = getattr(transformers, f"{name}Config")(
            text_config=text,
            vision_config={**TINY_VISION, "out_hidden_size": shape.hidden_size},
            tie_word_embeddings=text["tie_word_embeddings"],
        )
        model_cls = getattr(transformers, f"{name}ForConditionalGeneration")
    else:
        hf_config = getattr(transformers, f"{name}TextConfig")(**text)
        model_cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model_cls(hf_config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    write_generation_config(out, ids)
    return out


def _rewrite_tensors(out: Path, edit) -> None:
    """model.safetensors of `out` with `edit(tensors)` applied (a tiny model: one file)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _add_mtp(out: Path, seed: int) -> None:
    """A random MTP head named as the published checkpoints' (see the module docstring): the
    model's last full-attention layer's tensor names and shapes under `mtp.layers.0.`."""
    import torch

    cfg = json.loads((out / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    last = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    g = torch.Generator().manual_seed(seed + 1)

    def edit(tensors: dict) -> None:
        prefix = next(k for k in tensors if k.endswith(".embed_tokens.weight")).split("embed")[0]
        h = tensors[f"{prefix}norm.weight"].shape[0]
        layer = f"{prefix}layers.{last}."
        shapes = {"fc.weight": (h, 2 * h)} | {
            f"{n}.weight": (h,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        }
        for k, v in tensors.items():
            if k.startswith(layer):
                shapes["layers.0." + k[len(layer) :]] = tuple(v.shape)
        for name, shape in shapes.items():
            tensors["mtp." + name] = torch.randn(shape, generator=g) * 0.02

    _rewrite_tensors(out, edit)
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fuse_experts(out: Path, shape) -> None:
    """The decoder layers' experts as one gate_up_proj [E, 2 I, H] and down_proj [E, H, I]."""
    import torch

    def edit(tensors: dict) -> None:
        decoder = [k for k in tensors if ".mlp.experts." in k and not k.startswith("mtp.")]
        for p in sorted({k.split(".mlp.experts.")[0] + ".mlp.experts." for k in decoder}):
            gate_up, down = [], []
            for e in range(shape.num_experts):
                gate, up = (tensors.pop(f"{p}{e}.{n}_proj.weight") for n in ("gate", "up"))
                gate_up.append(torch.cat([gate, up]))
                down.append(tensors.pop(f"{p}{e}.down_proj.weight"))
            tensors[p + "gate_up_proj"], tensors[p + "down_proj"] = (
                torch.stack(gate_up),
                torch.stack(down),
            )

    _rewrite_tensors(out, edit)


def build_tiny_qwen3_5(
    out_dir: str | Path, *, seed: int = 0, conditional: bool = False, mtp: bool = False, **config
) -> Path:
    """Write a random Qwen3.5 of the "tiny-qwen3.5" shape (4 layers: 3 Gated DeltaNet, then
    gated full attention; head_dim 32, a quarter of it rotated; untied) and its tokenizer to
    `out_dir`: `Qwen3_5ForCausalLM`, or with conditional=True `Qwen3_5ForConditionalGeneration`;
    mtp=True adds the MTP head (the module docstring). config: text config fields that replace
    the defaults."""
    out = _write_tiny_qwen3_5(out_dir, TINY_QWEN3_5, seed, conditional, config)
    if mtp:
        _add_mtp(out, seed)
    return out


def build_tiny_qwen3_5_moe(
    out_dir: str | Path,
    *,
    seed: int = 0,
    conditional: bool = False,
    mtp: bool = False,
    fused_experts: bool = False,
    **config,
) -> Path:
    """Write a random Qwen3.5-MoE of the "tiny-qwen3.5-moe" shape (Qwen3.5's layers, every MLP
    8 routed experts, top-2, and a gated shared expert) and its tokenizer to `out_dir`; the
    layouts and mtp as build_tiny_qwen3_5, fused_experts as the module docstring says."""
    out = _write_tiny_qwen3_5(out_dir, TINY_QWEN3_5_MOE, seed, conditional, config)
    if mtp:
        _add_mtp(out, seed)
    if fused_experts:
        _fuse_experts(out, TINY_QWEN3_5_MOE)
    return out
