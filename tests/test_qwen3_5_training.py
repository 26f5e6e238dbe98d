"""GRPO on a Qwen3.5-shaped policy (recipes/tiny-qwen3.5-cpu.yaml, tiny-qwen3.5-moe-cpu.yaml).

    python -m pytest tests/test_qwen3_5_training.py     # ~1 min on 2 cores

- The recipe key `model.preset` takes the hybrid fields from the preset and the shape keys from
  the recipe; bad values, and vLLM rollouts of Gated DeltaNet on CPU, are refused by name.
- Padding (one spawned process, megatron-core): a left-padded prompt behind an attention mask
  gives the prompt's own logits on a pure-attention model but not on the hybrid one (the Gated
  DeltaNet layers read the pads); the built-in sampler, which batches prompts of one length and
  pads nothing, samples a prompt alike alone and beside longer ones; the trainer's right-padded
  rows give each row's own log-probs, the same row left-padded does not (control); packed (THD)
  micro-batches are refused by name.
- Routing replay on tiny-qwen3.5-moe (a shared expert beside the routed ones): replaying the
  routing the model chose reproduces its log-probs exactly; other experts change them.
- Two GRPO steps of the dense recipe from a 5-step warm start, through `megatron-ba train`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ba.parallel.parallel_layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / "recipes/tiny-qwen3.5-cpu.yaml"
MOE = ROOT / "recipes/tiny-qwen3.5-moe-cpu.yaml"
pytestmark = pytest.mark.stack


def test_the_preset_gives_the_hybrid_fields_and_the_recipe_the_shape():
    from megatron_ba.model_shape import PRESETS
    from megatron_ba.recipe import load_recipe

    for path, name in ((DENSE, "tiny-qwen3.5"), (MOE, "tiny-qwen3.5-moe")):
        recipe = load_recipe(path)
        assert recipe.model.preset == name and recipe.rollout.engine == "builtin"
        shape = recipe.model.fresh_shape(320)
        preset = PRESETS[name]
        for key in ("linear_attention_pattern", "linear_num_key_heads", "linear_key_head_dim"):
            assert getattr(shape, key) == getattr(preset, key)
        assert shape.family == preset.family and shape.attention_output_gate
        assert shape.rotary_percent == 0.25 and shape.norm_zero_centered
        assert shape.has_linear_attention and shape.vocab_size == 320
        assert shape.hidden_size == 128 and shape.rope_theta == 10000.0 != preset.rope_theta
        assert shape.shared_expert_ffn_hidden_size == preset.shared_expert_ffn_hidden_size
    assert load_recipe(DENSE).model.fresh_shape(320).ffn_hidden_size == 384  # the recipe's
    # Qwen3.5-MoE has no dense MLP: config.json reads the experts' width back as the FFN width.
    assert load_recipe(MOE).model.fresh_shape(320).ffn_hidden_size == 96
    # Without the key the same shape keys build the Qwen2 family (the control).
    plain = load_recipe(DENSE, ["model.preset=null"]).model.fresh_shape(320)
    assert plain.family == "qwen2" and not plain.has_linear_attention


@pytest.mark.parametrize(
    "path, overrides, words",
    [
        (DENSE, ["model.preset=tiny-qwen9"], r"model\.preset: 'tiny-qwen9' is not one of"),
        (DENSE, ["model.num_layers=2"], r"model\.linear_attention_pattern: .* per layer \(2\)"),
        (DENSE, ["model.num_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64"],
         r"model\.num_experts: 8 changes what the preset tiny-qwen3\.5 is \(dense\)"),
        (MOE, ["model.num_experts=0", "model.moe_router_topk=0", "model.moe_ffn_hidden_size=0",
               "model.moe_aux_loss_coeff=0"], r"model\.num_experts: 0 .* \(a mixture of experts\)"),
        (MOE, ["model.ffn_hidden_size=384"], r"model\.ffn_hidden_size: .* no dense MLP"),
        (DENSE, ["model.pretrained=/x", "warmstart.enabled=false", "tokenizer.kind=hf"],
         r"model\.preset: builds a fresh model"),
        (DENSE, ["parallel.tp=2", "parallel.cp=2"],
         r"parallel\.cp: linear_num_key_heads=2 is not a multiple of tp\*cp=2\*2"),
    ],
)  # fmt: skip
def test_bad_preset_settings_are_refused_by_name(path, overrides, words):
    from megatron_ba.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=words):
        load_recipe(path, overrides)


def test_vllm_on_cpu_is_refused_for_gated_deltanet_by_name():
    from megatron_ba.recipe import RecipeError, load_recipe
    from megatron_ba.recipe.validation import check_engine_serves

    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match=r"rollout\.engine: vllm .* bfloat16 only.*torchvis"):
            load_recipe(DENSE, ["rollout.engine=vllm"])
    recipe = load_recipe(DENSE)
    vllm = dataclasses.replace(recipe, rollout=dataclasses.replace(recipe.rollout, engine="vllm"))
    with pytest.raises(RecipeError, match=r"rollout\.engine"):  # a pretrained Qwen3.5, at start
        check_engine_serves(vllm, linear_attention=True, cuda=False)
    check_engine_serves(vllm, linear_attention=True, cuda=True)  # GPUs: vLLM's own kernels
    check_engine_serves(vllm, linear_attention=False, cuda=False)  # attention-only models
    assert load_recipe(ROOT / "recipes/tiny-cpu.yaml").rollout.engine == "vllm"


def _model(name: str, **fields):
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron import routing_replay as rr
    from megatron_ba.model_shape import PRESETS
    from megatron_ba.parallel import full_shape

    spec = mm.ModelSpec.of(dataclasses.replace(PRESETS[name], **fields))
    extra = {}
    if spec.num_experts:
        extra = rr.routing_replay_fields(spec.num_experts, ParallelLayout(), recompute="none")
    chunks = mm.build_model_chunks(spec, ddp=False, config=mm.transformer_config(spec, **extra))
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
    chunks[0].eval()
    return spec, chunks


def _last_logits(model, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The last position's logits of left-padded `rows` under the mask the old sampler used."""
    from megatron_ba.megatron.batching import causal_mask

    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return model(rows, positions, causal_mask(rows.shape[1], valid=valid))[:, -1]


def _left_padding(out: dict) -> None:
    """Left padding behind the mask: harmless for attention, not for Gated DeltaNet."""
    short, long_ = [5, 9, 14, 3, 7], [8, 2, 11, 6, 4, 12, 10, 13, 5]
    rows = torch.tensor([[0] * 4 + short, long_])
    valid = torch.tensor([[False] * 4 + [True] * 5, [True] * 9])
    alone_valid = torch.ones(1, 5, dtype=torch.bool)
    for name in ("debug", "tiny-qwen3.5"):
        _, chunks = _model(name, vocab_size=64)
        with torch.no_grad():
            padded = _last_logits(chunks[0], rows, valid)[0]
            alone = _last_logits(chunks[0], torch.tensor([short]), alone_valid)[0]
        out[f"left_padded_vs_alone/{name}"] = float((padded - alone).abs().max())


def _sampler_and_trainer_rows(out: dict) -> None:
    from megatron_ba.generation.builtin_sampler import BuiltinSampler
    from megatron_ba.generation.engine import Sample
    from megatron_ba.megatron.batching import MicroBatchSpec, check_packable
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.train.experience import build_experience

    _, chunks = _model("tiny-qwen3.5", vocab_size=64)
    short, long_ = [5, 9, 14, 3, 7], [8, 2, 11, 6, 4, 12, 10, 13, 5]
    sampler = BuiltinSampler(chunks[0], eos_token_id=1, pad_token_id=0, decode=str)
    kw = dict(n=2, temperature=1.0, max_tokens=6, seed=3)
    mixed = sampler.generate([short, long_], **kw)[0]
    alone = sampler.generate([short], **kw)[0]
    out["sampler_same_tokens"] = [s.token_ids for s in mixed] == [s.token_ids for s in alone]
    out["sampler_logprob_gap"] = max(
        abs(a - b)
        for x, y in zip(mixed, alone, strict=True)
        for a, b in zip(x.logprobs, y.logprobs, strict=True)
    )
    # The trainer's rows: prompt at column 0, right padding after the response.
    samples = [[Sample([4, 6], "", True)], [Sample([2, 2, 9, 6, 1], "", True)]]
    exp = build_experience([short, long_], samples, [1.0, 0.0], pad_id=0)
    out["right_padded_first_column"] = exp.tokens[:, 0].tolist()
    both, _ = compute_logprobs(chunks, exp.tokens, MicroBatchSpec(1))
    own = torch.tensor([[*short, 4, 6]])
    row, _ = compute_logprobs(chunks, own, MicroBatchSpec(1))
    out["right_padded_vs_alone"] = float((both[0, : own.shape[1]] - row[0]).abs().max())
    shifted = torch.tensor([[0] * 7 + [*short, 4, 6]])  # the same row, left-padded (control)
    left, _ = compute_logprobs(chunks, shifted, MicroBatchSpec(1))
    out["left_padded_row_vs_alone"] = float((left[0, 8:] - row[0, 1:]).abs().max())
    try:
        check_packable(chunks)
        out["thd_refused"] = ""
    except ValueError as e:
        out["thd_refused"] = str(e)


def _replay_on_the_shared_expert_model(out: dict) -> None:
    from megatron_ba.megatron import routing_replay as rr
    from megatron_ba.megatron.batching import causal_mask
    from megatron_ba.megatron.grpo_step import compute_logprobs

    spec, chunks = _model("tiny-qwen3.5-moe", vocab_size=64)
    model, k = chunks[0], spec.moe_router_topk
    out["shared_experts"] = sum(type(m).__name__ == "SharedExpertMLP" for m in model.modules())
    n, s = 3, 12
    tokens = torch.randint(2, 64, (n, s), generator=torch.Generator().manual_seed(4))
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    instances = rr.replay_instances(model)
    out["routers"] = len(instances)
    for inst in instances:
        inst.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(tokens, torch.arange(s).expand(n, s), causal_mask(s))
    recorded = [inst.get_recorded_indices() for inst in instances]  # [s * n, K], [s, b] order
    for inst in instances:
        inst.clear_router_replay_action()
    routed = torch.stack([e.reshape(s, n, k).transpose(0, 1) for e in recorded], dim=2)
    plain, _ = compute_logprobs(chunks, tokens)
    own, _ = compute_logprobs(chunks, tokens, routed_experts=routed)
    other, _ = compute_logprobs(chunks, tokens, routed_experts=(routed + 1) % spec.num_experts)
    out["replay_own_vs_plain"] = float((own - plain).abs().max())
    out["replay_other_vs_plain"] = float((other - plain).abs().max())


def worker(rank: int, port: int, out_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    from megatron_ba.megatron.startup import setup, teardown

    setup(ParallelLayout(dp=None), seed=0, backend="gloo", rank=rank, world_size=1, port=port)
    out: dict = {}
    _left_padding(out)
    _sampler_and_trainer_rows(out)
    _replay_on_the_shared_expert_model(out)
    teardown()
    Path(out_path).write_text(json.dumps(out))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from megatron_ba.parallel.world import free_port, spawn

    out = tmp_path_factory.mktemp("qwen3_5") / "out.json"
    spawn(worker, 1, (free_port(), str(out)))
    r = json.loads(out.read_text())
    print(r)
    return r


def test_left_padding_leaks_into_gated_deltanet_but_not_into_attention(measured):
    assert measured["left_padded_vs_alone/debug"] < 1e-5  # the mask hides the pads: attention
    assert measured["left_padded_vs_alone/tiny-qwen3.5"] > 1e-3  # DeltaNet reads them anyway


def test_the_builtin_sampler_samples_a_prompt_alike_alone_and_beside_longer_ones(measured):
    assert measured["sampler_same_tokens"]
    assert measured["sampler_logprob_gap"] < 1e-6


def test_the_trainers_right_padded_rows_are_each_rows_own(measured):
    assert measured["right_padded_first_column"] == [5, 8]  # every prompt starts at column 0
    assert measured["right_padded_vs_alone"] < 1e-5
    assert measured["left_padded_row_vs_alone"] > 1e-3  # the control: padding before it leaks
    assert measured["thd_refused"].startswith("parallel.max_tokens_per_microbatch: packed (THD)")


def test_replayed_routing_on_the_shared_expert_model(measured):
    assert measured["shared_experts"] == 4 and measured["routers"] == 4
    assert measured["replay_own_vs_plain"] == 0.0  # its own routing: the same forward exactly
    assert measured["replay_other_vs_plain"] > 1e-3  # other experts: other log-probs


# A 5-step warm start (not a useful policy: this checks that the pipeline runs and updates) and
# 2 GRPO steps of 4 prompts x 2 samples of at most 12 tokens, evaluated at steps 0 and 2.
KEYS = (
    "warmstart.steps=5",
    "grpo.steps=2",
    "grpo.prompts_per_step=4",
    "grpo.group_size=2",
    "grpo.max_new_tokens=12",
    "data.eval_prompts=4",
    "eval.samples=1",
    "eval.every=2",
    "checkpoint.every=0",
    "logging.plots=false",
    "logging.progress=false",
)


def test_two_grpo_steps_of_the_recipe(tmp_path):
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_ba.cli", "train", str(DENSE), *KEYS]
    cmd += ["--run-dir", str(run), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert math.isfinite(r["pg_loss"]) and math.isfinite(r["grad_norm"])
        assert r["rollout_correction/logprob_gap"] < 1e-4  # the sampler is the policy
    assert json.loads((run / "hf" / "config.json").read_text())["model_type"] == "qwen3_5_text"
