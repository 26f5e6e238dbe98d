"""The layout planner's arithmetic against hand computations (megatron_ba/planning/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_ba.cli import main as cli_main
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel.parallel_layout import ParallelLayout, balanced_stages
from megatron_ba.planning.cluster_layout import (
    RECOMPUTE_COST,
    NoLayoutFits,
    Settings,
    propose,
    rank_key,
)
from megatron_ba.planning.memory import (
    GIB,
    MemorySettings,
    VLLMShare,
    estimate,
    kv_cache_bytes_per_token,
    load_model,
    stage_params,
)

ROOT = Path(__file__).resolve().parents[1]


def plan(tp, pp, cp, dp, tokens, *, ep=1, etp=None, **step):
    """A layout as the planner builds one (sequence parallelism with tp > 1) and its step."""
    layout = ParallelLayout(tp, pp, cp, dp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    return layout, MemorySettings(tokens, **step)


Q7 = PRESETS["Qwen2.5-Math-7B"]

# Qwen2.5-Math-7B by hand: h 3584, 28 heads of 128, 4 KV heads, MLP 18944, vocab 152064, untied.
Q7_LAYER = (
    3584 * 3584  # q
    + 2 * 3584 * 512  # k, v (4 KV heads x 128)
    + 3584 * 3584  # o
    + 3584
    + 2 * 512  # q, k, v biases
    + 3 * 3584 * 18944  # gate, up, down
    + 2 * 3584  # two RMSNorms
)
Q7_TOTAL = 28 * Q7_LAYER + 2 * 152064 * 3584 + 3584
# The refit's transient beside a colocated engine (planning/generation_memory.py): the default
# 256 MiB bucket and one full tensor, the largest of stage 0 (the embedding, 152064 x 3584 bf16)
Q7_REFIT = 256 * 2**20 + 152064 * 3584 * 2


def test_parameter_counts_by_hand():
    assert Q7_LAYER == 233_057_792
    assert Q7.layer_params() == Q7_LAYER
    assert Q7.total_params() == Q7_TOTAL == 7_615_616_512  # the model card's "7.61B"
    # Qwen3-1.7B: no qkv bias, q/k norms, tied embeddings (the card's 1.7B; 1.4B non-embedding)
    q3 = PRESETS["Qwen3-1.7B"]
    layer = 2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 2 * 128 + 3 * 2048 * 6144 + 2 * 2048
    assert q3.layer_params() == layer
    assert q3.total_params() == 28 * layer + 151936 * 2048 + 2048
    assert round(PRESETS["Qwen2.5-32B"].total_params() / 1e9, 2) == 32.76  # card: 32.5B / 32.8B


def test_hf_config_gives_the_preset(tmp_path):
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = load_model(str(tmp_path))
    assert shape == ModelShape(**{**PRESETS["Qwen3-1.7B"].__dict__, "name": str(tmp_path)})
    assert load_model("Qwen/Qwen2.5-32B") is PRESETS["Qwen2.5-32B"]
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        load_model(str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("Qwen-does-not-exist")


def test_static_terms_by_hand():
    e = estimate(Q7, *plan(2, 1, 1, 16, 4096), gpu_mem_gib=80, vllm=None)
    assert e.weights == Q7_TOTAL / 2 * 2  # bf16, halved by TP
    assert e.grads == Q7_TOTAL / 2 * 4  # fp32 gradient buffer
    assert e.optimizer == Q7_TOTAL / 2 * 12 / 16  # fp32 master + 2 moments over 16 DP ranks
    # CP joins the optimiser's sharding group: dp 8 x cp 2 shards as dp 16 does
    e_cp = estimate(Q7, *plan(2, 1, 2, 8, 4096), gpu_mem_gib=80, vllm=None)
    assert e_cp.optimizer == e.optimizer


def test_activations_and_logits_by_hand():
    T = 4096
    e = estimate(Q7, *plan(2, 1, 1, 16, T), gpu_mem_gib=80, vllm=None)
    per_token_layer = 4 * 3584 + (3584 + 2 * 512) + 3584 + 3 * 18944  # elements
    assert per_token_layer == Q7.layer_activation_elements() == 79360
    assert e.activations_no_recompute == 28 * per_token_layer * 2 * T / 2
    assert e.activations_full_recompute == 28 * 3584 * 2 * T / 2 + per_token_layer * 2 * T / 2
    assert e.activations == e.activations_no_recompute  # recompute=False
    v_local = 152064 / 2
    assert e.logits_naive == T * v_local * (2 + 20)  # 20: measured, docs/performance.md
    assert e.logits_chunked == T * v_local * 4 + 2 * 1024 * v_local * 4
    assert e.logits == e.logits_chunked
    assert e.train_phase == e.weights + e.grads + e.optimizer + e.activations + e.logits
    # CP halves the tokens of every activation term; recompute picks the other variant
    half = estimate(Q7, *plan(2, 1, 2, 8, T, recompute=True), gpu_mem_gib=80, vllm=None)
    assert half.activations == half.activations_full_recompute
    assert half.activations_full_recompute == e.activations_full_recompute / 2


def test_fp32_logprob_path_by_hand():
    """NeMo-RL's DistributedLogprob on fp32 logits: three fp32 tensors of the logits' size at
    its peak (fp32 logits, shifted copy, exp; then logits, log-softmax, saved softmax): 12 bytes
    per logit of T x V / tp, megatron-core's path 8; CP splits the tokens, so the logits."""
    lo, step = plan(8, 1, 1, 4, 131072, recompute="full", logprobs="fp32")
    q32, per_byte = load_model("Qwen3-32B"), 131072 * (151936 / 8)
    e = estimate(q32, lo, step, gpu_mem_gib=79.11)
    assert e.logits == per_byte * 12 and round(e.logits / GIB, 2) == 27.82
    mega = estimate(q32, lo, replace(step, logprobs="megatron"), gpu_mem_gib=79.11)
    assert mega.logits == per_byte * 8 and e.train_phase - mega.train_phase == per_byte * 4
    cp4 = replace(lo, cp=4, dp=1)
    assert estimate(q32, cp4, step, gpu_mem_gib=79.11).logits == e.logits / 4


def test_te_fused_cross_entropy_by_hand():
    """Transformer Engine's fused cross entropy (megatron-core's cross_entropy_fusion_impl "te")
    writes the gradient into the bf16 logits in place: 2 bytes per logit of T x V / tp, and per
    token the fp32 loss and (max, sum, target logit), all-gathered over TP (4 + 12 + 12 tp);
    megatron-core's unfused path keeps 8 bytes per logit, NeMo-RL's log-prob pass 2 in TE's."""
    lo, step = plan(8, 1, 1, 4, 131072, recompute="full", logprobs="te")
    q32, per_byte = load_model("Qwen3-32B"), 131072 * (151936 / 8)
    e = estimate(q32, lo, step, gpu_mem_gib=79.11)
    assert e.logits == per_byte * 2 + 131072 * (4 + 12 + 12 * 8)
    assert round(e.logits / GIB, 2) == 4.65
    mega = estimate(q32, lo, replace(step, logprobs="megatron"), gpu_mem_gib=79.11)
    assert mega.train_phase - e.train_phase == per_byte * 6 - 131072 * 112
    one = replace(lo, tp=1, dp=32, sequence_parallel=False)  # no TP: no all-gathered statistics
    assert estimate(q32, one, step, gpu_mem_gib=79.11).logits == 131072 * (151936 * 2 + 16)
    passes = replace(step, logprob_tokens=4 * 4096)
    assert estimate(q32, lo, passes, gpu_mem_gib=79.11).logprob_logits == 4 * 4096 * 151936 / 8 * 2


def test_te_fp32_gradient_by_hand():
    """From Transformer Engine 2.18 its fused cross entropy keeps the gradient in a new fp32
    tensor (NVIDIA/TransformerEngine 01bbe3eea): 4 bytes per logit more than "te", in training
    and in a forward-only log-prob pass (2 + 4). Megatron-Bridge's report of the 64 x GB300
    Qwen3-30B-A3B run: an 18.55 GiB fp32 cross-entropy temporary at 8 x 4,096 tokens, TP 1."""
    lo, step = plan(8, 1, 1, 4, 131072, recompute="full", logprobs="te")
    q32, per_byte = load_model("Qwen3-32B"), 131072 * (151936 / 8)
    te = estimate(q32, lo, step, gpu_mem_gib=79.11)
    fp32_grad = estimate(q32, lo, replace(step, logprobs="te-fp32-grad"), gpu_mem_gib=79.11)
    assert fp32_grad.logits - te.logits == per_byte * 4
    assert fp32_grad.train_phase - te.train_phase == per_byte * 4
    passes = replace(step, logprobs="te-fp32-grad", logprob_tokens=4 * 4096)
    assert estimate(q32, lo, passes, gpu_mem_gib=79.11).logprob_logits == 4 * 4096 * 151936 / 8 * 6
    assert round(32768 * 151936 * 4 / GIB, 2) == 18.55  # the report's temporary, TP 1


def test_pipeline_stages_by_hand():
    pp2 = ParallelLayout(pp=2)
    assert stage_params(Q7, pp2, 0) == 14 * Q7_LAYER + 152064 * 3584
    assert stage_params(Q7, pp2, 1) == 14 * Q7_LAYER + 152064 * 3584 + 3584
    q3 = PRESETS["Qwen3-1.7B"]  # tied: the last stage holds its copy of the embedding
    assert stage_params(q3, pp2, 1) == 14 * q3.layer_params() + 151936 * 2048 + 2048
    assert stage_params(q3, ParallelLayout(), 0) == q3.total_params()
    e = estimate(Q7, *plan(1, 2, 1, 4, 8192), gpu_mem_gib=80, vllm=None)
    # 1F1B: stage 0 holds 2 micro-batches of its 14 layers, stage 1 one, plus the logits
    per_layer = Q7.layer_activation_elements() * 2 * 8192
    assert e.worst_stage == 0
    assert e.activations_no_recompute == 2 * 14 * per_layer


def test_uneven_pipeline_stages_by_hand():
    """Each stage holds the layers of the layout's own split (ParallelLayout.stage_layers), not
    ceil(L / pp) each: 28 layers over 3 stages as megatron-core balances them are 9, 10, 9."""
    lo = ParallelLayout(pp=3, dp=1, **balanced_stages(28, 3))
    assert lo.stage_layers(28) == (9, 10, 9)
    embedding = 152064 * 3584
    assert stage_params(Q7, lo, 0) == 9 * Q7_LAYER + embedding
    assert stage_params(Q7, lo, 1) == 10 * Q7_LAYER
    assert stage_params(Q7, lo, 2) == 9 * Q7_LAYER + embedding + 3584
    per_layer = Q7.layer_activation_elements() * 2 * 1024
    e = estimate(Q7, lo, MemorySettings(1024), gpu_mem_gib=80)
    # 1F1B: stage 0 keeps 3 micro-batches of its 9 layers (27 layer-activations), stage 1 two
    # of 10 (20): the first stage is the worst, with 3 x 9, not the old 3 x ceil(28 / 3) = 30
    assert e.worst_stage == 0 and e.activations_no_recompute == 3 * 9 * per_layer
    assert e.weights == stage_params(Q7, lo, 0) * 2
    # a pinned split: a light first stage (4, 12, 12) moves the worst to the last, its 12
    # layers beside the output layer (one micro-batch in flight)
    light = ParallelLayout(pp=3, dp=1, pp_first_stage_layers=4)
    e = estimate(Q7, light, MemorySettings(1024), gpu_mem_gib=80)
    assert e.worst_stage == 2 and e.activations_no_recompute == 1 * 12 * per_layer
    assert e.weights == (12 * Q7_LAYER + embedding + 3584) * 2
    with pytest.raises(ValueError, match=r"^--pp: num_layers=28 is not a multiple of pp=3"):
        estimate(Q7, ParallelLayout(pp=3, dp=1), MemorySettings(1024), gpu_mem_gib=80)
    with pytest.raises(ValueError, match=r"^--pp: 29 stages are more than the num_layers=28"):
        propose(Q7, nodes=1, gpus_per_node=29, gpu_mem_gib=80, max_response_len=1, only={"pp": 29})


def test_vllm_share():
    lo = plan(2, 1, 1, 16, 4096)
    alone = estimate(Q7, *lo, gpu_mem_gib=80, vllm=None)
    asleep = estimate(Q7, *lo, gpu_mem_gib=80, vllm=VLLMShare(0.5, sleeps=True))
    awake = estimate(Q7, *lo, gpu_mem_gib=80, vllm=VLLMShare(0.5, sleeps=False))
    assert asleep.train_phase == alone.train_phase
    # the trainer's weights, the engine's pool and the refit's bucket and tensor beside it
    assert asleep.generate_phase == alone.weights + 40 * GIB + Q7_REFIT
    assert asleep.vllm_kv_cache == 40 * GIB - Q7_TOTAL / 2 * 2
    assert awake.train_phase == alone.train_phase + 40 * GIB
    assert awake.peak == awake.train_phase
    # KV cache per token, per GPU of a TP-2 engine: K and V x 28 layers x 2 heads x 128 x bf16
    assert kv_cache_bytes_per_token(Q7, 2) == 2 * 28 * 2 * 128 * 2
    assert kv_cache_bytes_per_token(Q7, 8) == 2 * 28 * 1 * 128 * 2  # heads replicated past 4


def test_proposal_fits_and_prefers_data_parallelism():
    proposal = propose(Q7, nodes=4, gpus_per_node=8, gpu_mem_gib=80, max_response_len=3584,
                       group_size=16, prompts_per_step=32, vllm=None)  # fmt: skip
    j = proposal.to_json()
    assert j["tp"] * j["pp"] * j["cp"] * j["dp"] == 32
    assert j["memory_gib_per_gpu"] <= 0.9 * 80
    assert 512 % j["dp"] == 0
    # nothing with more DP (less model parallelism) fits: checked by estimating each of them
    for alt in j["alternatives"]:
        assert alt["dp"] <= j["dp"]
    assert f"parallel.tp={j['tp']}" in j["overrides"]
    assert f"parallel.micro_batch_size={j['micro_batch_size']}" in j["overrides"]
    # the micro-batch is the largest power of two within the budget
    bigger = replace(proposal.step, micro_batch_tokens=2 * proposal.step.micro_batch_tokens)
    if j["micro_batch_size"] < 32:
        assert estimate(Q7, proposal.layout, bigger, gpu_mem_gib=80).peak > 0.9 * 80 * GIB


def test_nothing_fits_says_what_came_closest():
    with pytest.raises(NoLayoutFits, match=r"closest layout .* add nodes"):
        propose(PRESETS["Qwen2.5-32B"], nodes=1, gpus_per_node=2, gpu_mem_gib=24,
                max_response_len=16384)  # fmt: skip
    with pytest.raises(ValueError, match="--nodes"):
        propose(Q7, nodes=0, gpus_per_node=8, gpu_mem_gib=80, max_response_len=100)


def test_layout_command_json(capsys):
    args = ["layout", "--model", "Qwen3-1.7B", "--nodes", "1", "--gpus-per-node", "8",
            "--gpu-mem", "80", "--max-response-len", "8192", "--group-size", "8",
            "--prompts-per-step", "16", "--json"]  # fmt: skip
    assert cli_main(args) == 0
    j = json.loads(capsys.readouterr().out)
    for key in ("tp", "pp", "cp", "dp", "memory_gib_per_gpu", "overrides", "breakdown_gib"):
        assert key in j
    assert j["tp"] * j["pp"] * j["cp"] * j["dp"] == 8
    assert cli_main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert "recipe overrides: parallel.tp=" in text and "optimizer (distributed)" in text
    assert cli_main([*args[:-1], "--group-size", "0"]) == 2
    assert "--group-size: must be >= 1" in capsys.readouterr().err
    # the optimiser states' dtype reaches the estimate: half the fp32 optimiser per GPU for bf16
    pinned = [*args, "--tp", str(j["tp"]), "--pp", str(j["pp"]), "--cp", str(j["cp"])]
    assert cli_main([*pinned, "--optimizer-states", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert j["optimizer_states"] == "fp32" and bf16["optimizer_states"] == "bf16"
    fp32_opt, bf16_opt = j["breakdown_gib"]["optimizer"], bf16["breakdown_gib"]["optimizer"]
    assert abs(bf16_opt - fp32_opt / 2) < 0.01, (fp32_opt, bf16_opt)
    text_args = [a for a in pinned if a != "--json"]
    assert cli_main([*text_args, "--optimizer-states", "bf16"]) == 0
    assert f"optimizer (distributed, bf16 states) {bf16_opt}" in capsys.readouterr().out


def test_vllm_share_is_one_recipe_key_with_one_default(monkeypatch):
    """rollout.gpu_memory_utilization: the planner's default share is the recipe's default, the
    planner names the key (and rollout.sleep) among its overrides, and the trainer hands the
    recipe's value to the engine."""
    import types

    from megatron_ba.planning.cluster_layout import DEFAULT_VLLM, propose
    from megatron_ba.planning.memory import VLLMShare, load_model
    from megatron_ba.recipe import RolloutSection, load_recipe
    from megatron_ba.train import engine_setup

    assert DEFAULT_VLLM.gpu_util == VLLMShare().gpu_util == RolloutSection().gpu_memory_utilization
    plan = propose(
        load_model("qwen2.5-math-7b"),
        nodes=1,
        gpus_per_node=8,
        gpu_mem_gib=80,
        max_response_len=3072,
        vllm=VLLMShare(0.55, sleeps=True),
    )
    assert {"rollout.gpu_memory_utilization=0.55", "rollout.sleep=true"} <= set(plan.overrides())
    seen = {}
    monkeypatch.setattr(engine_setup, "VLLMEngine", lambda *a, **kw: seen.update(kw))
    recipe = load_recipe(ROOT / "recipes/tiny-cpu.yaml", ["rollout.gpu_memory_utilization=0.45"])
    policy = types.SimpleNamespace(spec=types.SimpleNamespace(max_context=64))
    engine_setup.vllm_engine(recipe, ROOT, policy, None)
    assert seen["gpu_memory_utilization"] == 0.45


QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B's config.json, the keys the planner reads
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def test_moe_shape_from_config_and_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    shape = load_model(str(tmp_path / "config.json"))
    assert shape == ModelShape(**{**PRESETS["Qwen3-30B-A3B"].__dict__, "name": shape.name})
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128  # q, k, v, o, q/k norms
    assert shape.layer_dense_params() == attn + 2048 * 128 + 2 * 2048  # + router, two norms
    assert shape.layer_expert_params() == 128 * 3 * 2048 * 768
    assert round(shape.total_params() / 1e9, 2) == 30.53  # the card: 30.5B
    assert round(PRESETS["Qwen3-235B-A22B"].total_params() / 1e9, 1) == 235.1  # card: 235B
    shared = {**QWEN3_30B_A3B_CONFIG, "shared_expert_intermediate_size": 5632}
    (tmp_path / "config.json").write_text(json.dumps(shared))
    with_shared = load_model(str(tmp_path))
    assert with_shared.layer_dense_params() == shape.layer_dense_params() + 3 * 2048 * 5632 + 2048
    del shared["moe_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(shared))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        load_model(str(tmp_path))


def test_the_sixth_sets_presets_have_their_cards_parameter_counts():
    """Presets added for the sixth validation set, each against its model card's count (Qwen3-8B
    "8.2B", Llama 3.2 1B "1.23B", Llama 3.1 405B "405B", Qwen2.5-Math-1.5B "1.54B"); a tie flag
    flipped is off by its vocabulary's matrix, over the cards' rounding."""
    cards = {"Qwen3-8B": 8.2, "Llama-3.2-1B": 1.23, "Llama-3.1-405B": 405.0,
             "Qwen2.5-Math-1.5B": 1.54}  # fmt: skip
    for name, billions in cards.items():
        assert abs(PRESETS[name].total_params() / 1e9 - billions) < 0.01 * billions + 0.01, name
    untied = replace(PRESETS["Llama-3.2-1B"], tie_word_embeddings=False)
    assert abs(untied.total_params() / 1e9 - 1.23) > 0.25


def test_more_presets_have_their_cards_parameter_counts():
    """Presets added from Megatron-Bridge's providers, each against its model card's count
    (Qwen3-0.6B "0.6B", Qwen3-14B "14.8B", Qwen2.5-3B "3.09B", Llama 3.2 3B "3.21B", Llama 3.1
    70B "70.6B" as Llama 3.3 70B); untied, the tied ones are off by their vocabulary's matrix."""
    cards = {"Qwen3-0.6B": 0.6, "Qwen3-14B": 14.8, "Qwen2.5-3B": 3.09, "Llama-3.2-3B": 3.21,
             "Llama-3.1-70B": 70.6}  # fmt: skip
    for name, billions in cards.items():
        assert abs(PRESETS[name].total_params() / 1e9 - billions) < 0.01 * billions + 0.01, name
    for name in ("Qwen3-0.6B", "Qwen2.5-3B", "Llama-3.2-3B"):
        untied = replace(PRESETS[name], tie_word_embeddings=False)
        assert abs(untied.total_params() / 1e9 - cards[name]) > 0.15, name
    assert PRESETS["Llama-3.1-70B"].total_params() == PRESETS["Llama-3.3-70B"].total_params()


def test_moe_activations_by_hand():
    """Qwen3-30B-A3B's layer keeps per token: 4h, q/k/v and the attention output, the router's
    128 logits, and per routed copy (top 8) the expert's input and its gate, up and weighted
    SwiGLU output. No copy of the experts' outputs: megatron-core weights each copy inside the
    activation and unpermutes without probs (transformer/moe/experts.py, token_dispatcher.py)."""
    shape = PRESETS["Qwen3-30B-A3B"]
    h, q, kv, experts, k, fe = 2048, 32 * 128, 4 * 128, 128, 8, 768
    per_copy = h + 3 * fe
    assert shape.layer_activation_elements() == 4 * h + (q + 2 * kv) + q + experts + k * per_copy
    assert shape.layer_activation_elements() == 52_352
    # the control: counting each copy's returned output as well is k x h more (68,736)
    assert shape.layer_activation_elements() + k * h == 68_736
    shared = replace(shape, shared_expert_ffn_hidden_size=5632)
    assert shared.layer_activation_elements() == 52_352 + 3 * 5632  # a dense SwiGLU beside


def test_expert_parallelism_shards_experts_and_their_optimizer():
    moe = PRESETS["Qwen3-30B-A3B"]
    lo, step = plan(2, 1, 1, 8, 4096, ep=8, etp=1)  # whole experts on each GPU
    e = estimate(moe, lo, step, gpu_mem_gib=80, vllm=None)
    dense = stage_params(moe, lo, 0, experts=False) / 2
    experts = stage_params(moe, lo, 0, experts=True) / 8
    assert e.weights == (dense + experts) * 2
    assert e.grads == (dense + experts) * 4
    # dense states over DP x CP = 8; experts over their data-parallel group, tp cp dp / ep = 2
    assert e.optimizer == (dense / 8 + experts / 2) * 12
    hybrid = estimate(moe, lo, replace(step, cpu_adam=0.75), gpu_mem_gib=80)
    assert hybrid.optimizer == e.optimizer / 4
    replicated = estimate(moe, lo, replace(step, distributed_optimizer=False), gpu_mem_gib=80)
    assert replicated.optimizer == (dense + experts) * 12
    # expert TP (megatron-core's default: tp) splits each expert's matrices too
    etp2 = estimate(moe, replace(lo, etp=2), step, gpu_mem_gib=80)
    assert etp2.weights == (dense + experts / 2) * 2 and etp2.optimizer == e.optimizer
    with pytest.raises(ValueError, match=r"^--ep: 3 does not divide the 128 experts"):
        estimate(moe, *plan(2, 1, 1, 12, 4096, ep=3, etp=1), gpu_mem_gib=80)
    with pytest.raises(ValueError, match=r"^--ep: needs a mixture-of-experts model; .* dense"):
        estimate(Q7, *plan(2, 1, 1, 8, 4096, ep=2), gpu_mem_gib=80)


def test_offload_modes_and_overheads():
    lo, step = plan(2, 1, 1, 4, 10240)
    share = VLLMShare(0.6, sleeps=True, tp=1)
    auto = estimate(Q7, lo, step, gpu_mem_gib=80, vllm=share)
    kept = estimate(Q7, lo, replace(step, offload="none"), gpu_mem_gib=80, vllm=share)
    gone = estimate(Q7, lo, replace(step, offload="states"), gpu_mem_gib=80, vllm=share)
    # the weights stay while vLLM sleeps; the refit's bucket and full tensor come on top
    assert auto.generate_phase == auto.weights + 48 * GIB + Q7_REFIT
    assert kept.generate_phase == kept.weights + kept.grads + kept.optimizer + 48 * GIB + Q7_REFIT
    # states offloaded: the weights come back for the refit, which reads them
    assert gone.generate_phase == gone.weights + 48 * GIB + Q7_REFIT
    assert gone.train_phase == kept.train_phase == auto.train_phase  # all back for the update
    # overheads: outside PyTorch, a fraction of what PyTorch holds (vLLM's pool excluded) and
    # the engine's own process
    from megatron_ba.planning.generation_memory import ENGINE_PROCESS_GIB
    from megatron_ba.planning.memory import FRAGMENTATION, NON_TORCH_GIB

    assert kept.peak_phase == "generate"
    torch_part = kept.generate_phase - 48 * GIB
    outside = (NON_TORCH_GIB + ENGINE_PROCESS_GIB) * GIB
    assert kept.total == pytest.approx(kept.peak + outside + FRAGMENTATION * torch_part)
    # a reference policy's weights stay in both phases
    ref = estimate(Q7, lo, replace(step, reference=True), gpu_mem_gib=80, vllm=share)
    assert ref.generate_phase == auto.generate_phase + auto.weights
    # selective recomputation keeps what none keeps (flash attention saves no scores)
    sel = estimate(Q7, lo, replace(step, recompute="selective"), gpu_mem_gib=80)
    assert sel.activations == auto.activations_no_recompute


def test_layout_command_new_flags(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    base = ["layout", "--nodes", "2", "--gpus-per-node", "8", "--json"]
    args = [*base, "--model-config", str(tmp_path), "--gpu", "H100", "--seq-len", "1536",
            "--tp", "4", "--pp", "2", "--ep", "8", "--recompute", "full", "--micro-batch-size",
            "4", "--offload", "none,cpu-adam=0.5"]  # fmt: skip
    assert cli_main(args) == 0
    j = json.loads(capsys.readouterr().out)
    assert (j["tp"], j["pp"], j["ep"], j["dp"], j["recompute_mode"]) == (4, 2, 8, 2, "full")
    assert j["micro_batch_tokens"] == 4 * 1536 and j["cpu_adam"] == 0.5 and j["fits"] is True
    assert j["gpu_mem_gib"] == 79.11 and j["peak_phase"] in ("train", "generate")
    # a layout that cannot fit: exit 1, the closest printed with fits false
    big = [*base, "--model", "Qwen2.5-72B", "--gpu-mem", "80", "--seq-len", "8192", "--tp", "1",
           "--pp", "1", "--cp", "1", "--vllm-gpu-util", "0"]  # fmt: skip
    assert cli_main(big) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["fits"] is False and "does not fit" in out.err
    for bad, message in (
        (["--gpu", "V100"], "--gpu V100"),
        (["--gpu", "H100", "--gpu-mem", "80"], "--gpu or --gpu-mem"),
        (["--offload", "disk"], "--offload disk"),
        (["--offload", "cpu-adam=2"], "F must be in"),
        (["--ep", "0"], "--ep: must be >= 1"),
    ):
        gpu = [] if "--gpu" in bad else ["--gpu", "H100"]
        cmd = [*base, "--model", "Qwen3-30B-A3B", "--seq-len", "1024", *gpu, *bad]
        assert cli_main(cmd) == 2, bad
        assert message in capsys.readouterr().err


def test_launch_memory_check(tmp_path, capsys):
    """The launcher's verdict on a recipe: the shipped 32B recipe at 80 GiB per GPU, through
    python -m megatron_ba.planning.launch fit with the checkpoint's config.json."""
    from megatron_ba.planning import launch

    s = PRESETS["Qwen2.5-32B"]
    cfg = {"model_type": "qwen2", "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers,
           "num_attention_heads": s.num_attention_heads, "intermediate_size": s.ffn_hidden_size,
           "num_key_value_heads": s.num_query_groups, "vocab_size": s.vocab_size}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    recipe = str(ROOT / "recipes/qwen2.5-32b-dapo17k-16k.yaml")
    fit = ["fit", recipe, f"model.pretrained={tmp_path}", "--nodes", "4", "--gpus-per-node", "8",
           "--gpu-mem", "80"]  # fmt: skip
    assert launch.main(fit) == 0  # as shipped: rollout.engine_tp 4, what the planner proposes
    assert "RECIPE_TP=4" in capsys.readouterr().out
    assert launch.main([*fit, "parallel.recompute=none"]) == launch.FIT_EXIT
    assert "it fits with parallel.recompute=full" in capsys.readouterr().err
    # a one-GPU vLLM engine cannot hold the 32B weights in its share
    assert launch.main([*fit, "rollout.engine_tp=1"]) == launch.FIT_EXIT
    assert "it fits with rollout.engine_tp=2" in capsys.readouterr().err


def test_vllm_engine_tp_is_part_of_the_verdict(capsys):
    """A one-GPU engine cannot hold the 32B weights in 0.6 of 80 GiB: no layout fits, the
    closest says why; with --vllm-tp 2 the shipped recipe's layout comes back."""
    args = ["layout", "--model", "Qwen2.5-32B", "--nodes", "4", "--gpus-per-node", "8",
            "--gpu-mem", "80", "--max-response-len", "16384", "--prompt-len", "1024",
            "--group-size", "16", "--prompts-per-step", "128", "--json"]  # fmt: skip
    assert cli_main([*args, "--vllm-tp", "1"]) == 1
    out = capsys.readouterr()
    j = json.loads(out.out)
    assert j["fits"] is False and "cannot hold one sequence's KV cache" in j["why_not"]
    assert cli_main([*args, "--vllm-tp", "2"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert (j["tp"], j["micro_batch_size"], j["fits"], j["why_not"]) == (4, 2, True, "")


def test_compute_ranking_prefers_no_recomputation_by_hand(capsys):
    """Settings(prefer="compute"), least recomputed compute first: Qwen2.5-1.5B at 262,144
    tokens on 4 x 8 GPUs of 79.11 GiB; the default recomputes, this splits the sequence more."""
    shape = load_model("Qwen2.5-1.5B")
    a = 4 * 1536 + (1536 + 2 * 256) + 1536 + 3 * 8960  # h, q, 2 KV heads of 128, MLP 8960
    assert a == shape.layer_activation_elements() == 36608
    kw = dict(nodes=4, gpus_per_node=8, gpu_mem_gib=79.11, max_response_len=1, seq_len=262144)
    default = propose(shape, **kw)
    d = default.layout
    compute = propose(shape, **kw, settings=Settings(prefer="compute"))
    lo = compute.layout
    assert default.step.recompute_mode == "full" and compute.step.recompute_mode == "none"
    assert (lo.tp, lo.pp, lo.cp, lo.dp) == (2, 1, 8, 2)
    assert compute.estimate.activations == 28 * a * 2 * (262144 / 8) / 2  # bf16, / cp, / tp
    assert 28 * a * 2 * 262144 / (d.tp * d.cp) / GIB > 0.9 * 79.11  # the default's, unrecomputed
    assert RECOMPUTE_COST["full"] == (6 + 2) / 6  # a second forward, 2 N S on 6 N S
    assert rank_key(d, default.step, 1, "compute") > rank_key(lo, compute.step, 1, "compute")
    # the default ranks by model parallelism first
    assert rank_key(d, default.step, 1) < rank_key(lo, compute.step, 1)
    with pytest.raises(ValueError, match="prefer"):
        propose(shape, **kw, settings=Settings(prefer="speed"))
    cli = ["layout", "--model", "Qwen2.5-1.5B", "--seq-len", "262144", "--nodes", "4", "--json"]
    capsys.readouterr()
    assert cli_main([*cli, "--gpus-per-node", "8", "--gpu", "H100", "--prefer", "compute"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [out[k] for k in ("tp", "cp", "dp", "recompute_mode")] == [2, 8, 2, "none"]


def test_tp_above_the_kv_heads_keeps_a_whole_kv_head_per_rank():
    """Qwen2.5-1.5B (2 KV heads of 128) at tp 4 with sequence parallelism: a layer keeps its
    elements / tp per token, plus the one KV head's k and v each rank keeps where an even split
    would keep half a head (2 x 128 x (1 - 2/4)); at tp 2 nothing is added. The search never
    proposes tp 4 for it; pinned, it is planned."""
    from megatron_ba.planning.memory import PRECISION, layer_activations

    shape = load_model("Qwen2.5-1.5B")
    a, n = shape.layer_activation_elements(), 1000
    tp4 = ParallelLayout(tp=4, sequence_parallel=True)
    assert layer_activations(shape, tp4, PRECISION, n) == 2 * n * (a / 4 + 2 * 128 * (1 - 2 / 4))
    tp2 = ParallelLayout(tp=2, sequence_parallel=True)
    assert layer_activations(shape, tp2, PRECISION, n) == 2 * n * a / 2
    kw = dict(nodes=1, gpus_per_node=8, gpu_mem_gib=79.11, max_response_len=1, seq_len=32768)
    assert propose(shape, **kw).layout.tp <= 2
    cli = ["layout", "--model", "Qwen2.5-1.5B", "--seq-len", "32768", "--nodes", "1", "--json"]
    assert cli_main([*cli, "--gpus-per-node", "8", "--gpu", "H100", "--tp", "4"]) == 0


def test_interleaved_stages_hold_megatron_cores_warm_up_by_hand():
    """--vp V: megatron-core's interleaved 1F1B. pp 4, V 2, first stage: (4 - 0 - 1) x 2 +
    (2 - 1) x 4 + 1 = 11 chunk micro-batches of half the stage's layers, 5.5 micro-batches'
    worth against the plain schedule's 4 (1 + 1/2 - 1/8 = 1.375); the last stage: 0 + 4 + 1 = 5,
    2.5 against 1. With 2 micro-batches per rank: every chunk of both, 2 micro-batches' worth.
    The activations follow; --vp without a pinned pp > 1 is refused naming the flag."""
    from megatron_ba.planning.memory import in_flight_tokens

    layout = ParallelLayout(pp=4)
    plain, interleaved = MemorySettings(1000), MemorySettings(1000, virtual_pipeline=2)
    assert in_flight_tokens(plain, layout, 0) == (4, 4000)
    assert in_flight_tokens(interleaved, layout, 0) == (11, 5500)
    assert in_flight_tokens(interleaved, layout, 3) == (5, 2500)
    two = replace(interleaved, step_tokens=2000)  # 2 micro-batches on the one DP rank
    assert in_flight_tokens(two, layout, 0) == (4, 2000)
    shape = load_model("Qwen2.5-7B")
    acts = [estimate(shape, layout, s, gpu_mem_gib=80).activations for s in (plain, interleaved)]
    assert acts[1] / acts[0] == pytest.approx(1.375)
    cli = ["layout", "--model", "Qwen2.5-7B", "--seq-len", "4096", "--nodes", "1", "--json"]
    assert cli_main([*cli, "--gpus-per-node", "8", "--gpu", "H100", "--vp", "2"]) == 2
    with pytest.raises(ValueError, match="--vp: must be an integer >= 1"):
        MemorySettings(1000, virtual_pipeline=0)
