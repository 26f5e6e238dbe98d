"""The named shapes: the paper's and the public record's models, each from its release's
config.json (sources beside them), and the tiny debug models the CPU runs build
(tiny_presets.py).

    PRESETS["Qwen2.5-Math-7B"]; preset("qwen/qwen2.5-math-7b-instruct")   # case-insensitive
"""

from __future__ import annotations

from megatron_ba.model_shape.llama_presets import LLAMA_PRESETS
from megatron_ba.model_shape.shape import ModelShape
from megatron_ba.model_shape.tiny_presets import TINY_PRESETS, qwen3


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


PRESETS: dict[str, ModelShape] = {
    # The paper's models (and two the planner is compared with in docs/cluster-planning.md): the
    # values of each model's public config.json on the Hugging Face hub that the planner reads;
    # max_position_embeddings, rope_theta and norm_eps are left at the defaults.
    "Qwen2.5-Math-7B": ModelShape(152064, 3584, 28, 28, 4, 18944, name="Qwen2.5-Math-7B"),
    "Qwen3-1.7B": qwen3(
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
    "Qwen3-32B": qwen3(
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
    "Qwen3-4B": qwen3(
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
    # Qwen/Qwen3-0.6B and Qwen/Qwen3-14B (Megatron-Bridge src/megatron/bridge/models/qwen/
    # qwen_provider.py @fcc2063bc^, Qwen3ModelProvider600M and 14B over Qwen3ModelProvider:
    # vocab 151936, heads of 128, 8 KV heads; the 0.6B tied, the 14B not), and Qwen/Qwen2.5-3B
    # (Qwen25ModelProvider3B: vocab 151936, tied, q/k/v bias). Their cards' counts (0.6B, 14.8B,
    # 3.09B): tests/test_layout_planner.py.
    "Qwen3-0.6B": qwen3(
        "Qwen3-0.6B",
        vocab_size=151936,
        hidden_size=1024,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=3072,
        kv_channels=128,
        tie_word_embeddings=True,
    ),
    "Qwen3-14B": qwen3(
        "Qwen3-14B",
        vocab_size=151936,
        hidden_size=5120,
        num_layers=40,
        num_attention_heads=40,
        num_query_groups=8,
        ffn_hidden_size=17408,
        kv_channels=128,
    ),
    "Qwen2.5-3B": ModelShape(
        151936, 2048, 36, 16, 2, 11008, tie_word_embeddings=True, name="Qwen2.5-3B"
    ),
    # Qwen/Qwen3-8B (the -Base checkpoint has the same shapes, max_position_embeddings 32768):
    # hidden 4096, 36 layers, 32 heads of 128, 8 KV heads, intermediate 12288, vocab 151936,
    # untied (citsjtu2020/LLM-Prof sglang/Model_Config.md @8434c8d, its config.json verbatim;
    # Megatron-Bridge src/megatron/bridge/models/qwen/qwen_provider.py @07d0d14
    # Qwen3ModelProvider8B and litgpt agree).
    "Qwen3-8B": qwen3(
        "Qwen3-8B",
        vocab_size=151936,
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=12288,
        kv_channels=128,
        max_position_embeddings=40960,
    ),
    "Qwen3-30B-A3B": qwen3(
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
    "Qwen3-235B-A22B": qwen3(
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
    # Qwen/Qwen3.5-122B-A10B (NVIDIA-NeMo/Megatron-Bridge docs/models/qwen/qwen35-vl.md: "122B
    # total parameters, 10B activated"); its config.json was not found, its shape is that of
    # two independent Megatron argument lists that agree: hidden 3072, 48 layers, 32 heads, 2 KV
    # heads of 256, 64 DeltaNet value heads (16 key heads of 128), 256 experts of 1024, top 8, a
    # gated shared expert of 1024, vocab 248320, untied, one MTP layer (Osmosis-AI/miles
    # scripts/models/qwen3.5-122B-A10B.sh @9449f84; BestJuly/Megatron-LM examples/
    # multimodal_dev/scripts/run_qwen35_vl.sh @f6d63f6, variant 122b_a10b).
    "Qwen3.5-122B-A10B": _qwen3_5(
        "Qwen3.5-122B-A10B",
        48,
        family="qwen3_5_moe",
        hidden_size=3072,
        num_attention_heads=32,
        num_query_groups=2,
        ffn_hidden_size=1024,
        linear_num_value_heads=64,
        num_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=1024,
        shared_expert_ffn_hidden_size=1024,
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
    # Qwen/Qwen2.5-Math-1.5B(-Instruct): Qwen2.5-1.5B's shapes (hidden 1536, 28 layers, 12
    # heads, 2 KV heads, intermediate 8960, vocab 151936, q/k/v bias) with rope_theta 10000 and
    # 4096 positions (litgpt litgpt/config.py @2685705; NVIDIA NeMo-Skills' docs edit those two
    # keys of its config.json); tied as the Qwen2.5 1.5B models are (not seen in a copy of this
    # config.json itself).
    "Qwen2.5-Math-1.5B": ModelShape(
        151936,
        1536,
        28,
        12,
        2,
        8960,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        name="Qwen2.5-Math-1.5B",
    ),
    "qwen2.5-1.5b": ModelShape(
        151936, 1536, 28, 12, 2, 8960, tie_word_embeddings=True, name="qwen2.5-1.5b"
    ),
}

# The CPU-sized debug shapes (tiny_presets.py) beside the released models'.
PRESETS.update(LLAMA_PRESETS)
PRESETS.update(TINY_PRESETS)


def preset(name: str) -> ModelShape:
    """A preset by name (case-insensitive; a hub id's `Qwen/` prefix is ignored)."""
    key = name.split("/")[-1].lower()
    for suffix in ("", "-instruct", "-base"):
        for preset_name, shape in PRESETS.items():
            if preset_name.lower() + suffix == key:
                return shape
    raise KeyError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
