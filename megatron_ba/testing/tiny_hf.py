"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE Hugging Face models, built offline (tests, CPU demos).

    from megatron_ba.testing.tiny_hf import build_tiny_qwen2, build_tiny_qwen3
    model_dir = build_tiny_qwen2("/tmp/tiny")     # config.json, model.safetensors, tokenizer
    model_dir = build_tiny_qwen3("/tmp/tiny3")    # or: megatron-ba tiny-model /tmp/tiny3
    model_dir = build_tiny_qwen3_moe("/tmp/moe")  # tiny-model /tmp/moe --family qwen3_moe
    # vllm: LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=1024)

The tokenizer is a byte-level BPE trained here with `tokenizers` on a small built-in corpus
(math, code and prompt-template words) and wrapped as PreTrainedTokenizerFast with a ChatML
chat template, so every string can be encoded and chat templating works as with a real model.
Sizes: hidden 128 with 4 heads (head_dim 32, the smallest the vLLM CPU attention backend takes).
Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ba.model_shape import PRESETS
from megatron_ba.tokenization import train_bpe

# The models' default shapes ("tiny-qwen2", "tiny-qwen3", "tiny-moe"; the vocabulary is the
# tokenizer's size).
TINY_QWEN2, TINY_QWEN3, TINY_MOE = PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"], PRESETS["tiny-moe"]
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


def _write_tiny(out_dir: str | Path, family: str, vocab_size: int, seed: int, **shape) -> Path:
    """The tokenizer, a random model of `family` with `shape`, and a generation config."""
    import torch
    from transformers import (
        GenerationConfig,
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
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save_pretrained(out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = config_cls(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,  # as the small Qwen2 / Qwen3 releases
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        **shape,
    )
    torch.manual_seed(seed)
    model_cls(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(out)
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
