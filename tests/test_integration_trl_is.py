"""BalancedGRPOTrainer with TRL's vLLM importance-sampling correction and a MoE router loss.

No vLLM runs: the generation step (`_generate`, which returns vLLM's per-token log-probs) is
replaced by a fixed one whose sampling log-probs differ from the trainer's, and TRL's own
`_generate_and_score_completions` then scores the batch and computes its importance-sampling
ratios (`importance_sampling_ratio`, after its truncation or masking) as it does with vLLM.
Both trainers get their log-probs from one float64 function (TRL's fused LM head rounds them to
float32), so the comparisons are of the loss arithmetic, to float64 round-off:

- the core's token / sequence / dr_grpo rules with TRL's ratios equal TRL's own `_compute_loss`
  (`dapo` / `grpo` / `dr_grpo`) in each of TRL's four modes and its default, value and gradient;
- with a KL term the ratios weight the PPO term only, as in TRL;
- `balanced` with TRL's ratios equals BA's float64 definition (tests/rule_reference.py) with the
  same per-token weights, in one step and over accumulation micro-batches;
- a tiny Qwen3-MoE: the router's load-balancing loss is added as TRL adds it (value, gradient,
  under gradient accumulation), and leaving it out is seen to differ.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

trl = pytest.importorskip("trl")

from rule_reference import balanced_objective, clipped_terms  # noqa: E402
from test_integration_trl import (  # noqa: E402
    GA,
    MAX_LEN,
    PROMPT_LEN,
    G,
    _gradient,
    _max_rel_diff,
    _trainer,
    _use,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402

from megatron_ba.integrations.trl import BalancedGRPOTrainer  # noqa: E402
from megatron_ba.testing.tiny_hf import build_tiny_qwen2  # noqa: E402

LENGTHS = [1, 6, 2, 5, 3, 3, 6, 4]  # two prompts x G completions
REWARDS = [1, 0, 1, 0, 0, 1, 0, 0]  # the test reward: len(text) % 2
_DEFAULT = GRPOConfig.__dataclass_fields__
# (mode, clip_min, clip_max): TRL's four modes with both caps, and its defaults as they come
MODES = {
    "token_truncate": ("token_truncate", 0.5, 2.0),
    "token_mask": ("token_mask", 0.5, 2.0),
    "sequence_truncate": ("sequence_truncate", 0.5, 2.0),
    "sequence_mask": ("sequence_mask", 0.5, 2.0),
    "default": tuple(
        _DEFAULT[f"vllm_importance_sampling_{k}"].default for k in ("mode", "clip_min", "clip_max")
    ),
}


def _float64_logps(trainer):
    """Give `trainer` log-probs (and entropies, the router loss) computed in float64 from the
    model's logits; TRL's and this trainer's loss code run on them unchanged."""

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        extra = {"output_router_logits": True} if kwargs.get("compute_aux_loss") else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        logits = out.logits[:, -logits_to_keep - 1 : -1].to(torch.float64) / trainer.temperature
        logp = logits.log_softmax(-1)
        token = logp.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if kwargs.get("compute_entropy") else None
        return token, entropy, (out.aux_loss if extra else None)

    trainer._get_per_token_logps_and_entropies = logps_and_entropies
    return trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_is"), num_layers=1)


@pytest.fixture(scope="module")
def ours(model_dir, tmp_path_factory):
    return _float64_logps(_trainer(BalancedGRPOTrainer, model_dir, tmp_path_factory.mktemp("o")))


@pytest.fixture(scope="module")
def theirs(model_dir, tmp_path_factory):
    return _float64_logps(_trainer(GRPOTrainer, model_dir, tmp_path_factory.mktemp("t")))


def _with_vllm(trainer, mode, clip_min, clip_max, correction=True):
    """The trainer as GRPOConfig(use_vllm=True, ...) sets it up (no vLLM engine is built)."""
    return _use(
        trainer,
        use_vllm=True,
        vllm_importance_sampling_correction=correction,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )


def _fake_vllm_generate(trainer, seed):
    """`_generate` as TRL's vLLM path returns it: fixed prompts and completions, with sampling
    log-probs = the trainer's log-probs minus N(0, 0.6^2) noise per token."""
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    prompts = torch.randint(3, 400, (n, PROMPT_LEN), generator=g)
    completions = [torch.randint(3, 400, (t,), generator=g) for t in LENGTHS]

    def generate(prompt_texts):
        assert len(prompt_texts) == n
        logps = []
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.cat([p, c])[None]
            with torch.no_grad():
                lp, _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, torch.ones_like(ids), c.numel()
                )
            logps.append((lp[0] - 0.6 * torch.randn(c.numel(), generator=g)).tolist())
        texts = ["x" * (t + (t + r) % 2) for t, r in zip(LENGTHS, REWARDS, strict=True)]
        ids = [p.tolist() for p in prompts], [c.tolist() for c in completions]
        return (*ids, None, texts, logps, {}, None, [])

    return generate


def _vllm_batch(trainer, seed=0):
    """A generation batch scored by TRL's `_generate_and_score_completions` (vLLM's log-probs
    from `_fake_vllm_generate`), then old log-probs moved off the current policy by fixed noise,
    as after a policy update, so that PPO clipping is active too."""
    trainer.model.train()
    trainer._generate = _fake_vllm_generate(trainer, seed)
    inputs = [{"prompt": f"What is {i // G} + {i // G}?"} for i in range(len(LENGTHS))]
    batch = trainer._generate_and_score_completions(inputs)
    del trainer._generate
    g = torch.Generator().manual_seed(seed + 1)
    old = batch.get("old_per_token_logps")
    if old is None:  # TRL stores none without vLLM's correction (one generation batch per step)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, MAX_LEN)
    batch["old_per_token_logps"] = old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype)
    assert [int(x) for x in batch["completion_mask"].sum(1)] == LENGTHS
    assert (batch["advantages"] != 0).all()
    return batch


def _check_ratios_exercise(batch, mode, clip_min, clip_max):
    """The batch's ratios hit what `mode` does: some masked to 0 or truncated to a cap, some not."""
    mask = batch["completion_mask"].bool()
    c = batch["importance_sampling_ratio"]
    c = c[mask] if c.shape[1] > 1 else c.flatten()
    if mode.endswith("mask"):
        assert (c == 0).any() and (c > 0).any()
    else:
        caps = [x for x in (clip_min, clip_max) if x is not None]
        assert any((c == x).any() for x in caps) and (c != 1).all()
    assert c.unique().numel() > 2


@pytest.mark.parametrize("case", sorted(MODES))
@pytest.mark.parametrize(
    ("trl_loss", "rule"), [("dapo", "token"), ("grpo", "sequence"), ("dr_grpo", "dr_grpo")]
)
def test_vllm_is_with_trls_loss_types_equals_trls_compute_loss(ours, theirs, case, trl_loss, rule):
    """The core's rule at batch scope with TRL's ratios as `is_weights` equals TRL's own
    `_compute_loss` on the same batch (value and gradient, float64 round-off).

    Negative control, differing only in where the weight goes: the unweighted loss times the
    batch's mean weight (the weight applied after aggregation) is off by > 1%, in every case.
    Seen failing, the trainer changed for the run: with each row's mean weight on all its tokens
    (per sequence instead of per token), the 6 token-mode cases; with the plan's lengths counting
    only the tokens a mask mode keeps (c > 0), the mask modes' cases."""
    mode, clip_min, clip_max = MODES[case]
    ref = _with_vllm(_use(theirs, loss_type=trl_loss), mode, clip_min, clip_max)
    no_kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.0)  # TRL's beta is 0 here
    plan = dataclasses.replace(ours.ba_aggregation, rule=rule, scope="batch")
    me = _with_vllm(_use(ours, ba_aggregation=plan, ba_loss_config=no_kl), mode, clip_min, clip_max)
    batch = _vllm_batch(me, seed=4)
    _check_ratios_exercise(batch, mode, clip_min, clip_max)
    loss_ref, g_ref = _gradient(ref, [batch], ga=1, spg=1)
    loss_ours, g_ours = _gradient(me, [batch], ga=1, spg=1)
    assert abs(loss_ref - loss_ours) < 1e-12 * abs(loss_ref)
    assert _max_rel_diff(g_ref, g_ours) < 1e-10
    # control: the same loss with the weight applied after aggregation
    mask = batch["completion_mask"].bool()
    c_mean = float(batch["importance_sampling_ratio"].expand(mask.shape)[mask].mean())
    loss0, g0 = _gradient(_use(me, vllm_importance_sampling_correction=False), [batch], ga=1, spg=1)
    assert abs(c_mean * loss0 - loss_ref) > 1e-2 * abs(loss_ref)
    assert _max_rel_diff(g_ref, {k: c_mean * v for k, v in g0.items()}) > 1e-2


def test_vllm_is_leaves_the_kl_term_unweighted_as_trl_does(ours, theirs):
    """With a KL term (TRL's beta, the core's kl_coef on the token-mean regulariser plan) and TRL's
    default correction, aggregation="token" equals TRL's `dapo`: the ratios weight the PPO term
    only, the KL term is left unweighted (value and gradient, float64 round-off). Negative control,
    differing only in where the weight goes: the KL term weighted by the ratios too changes the
    loss by > 1%."""
    beta = 0.5
    ref = _with_vllm(_use(theirs, loss_type="dapo", beta=beta), *MODES["default"])
    kl = dataclasses.replace(ours.ba_loss_config, kl_coef=beta)
    plan = dataclasses.replace(ours.ba_aggregation, rule="token", scope="batch")
    me = _with_vllm(_use(ours, ba_aggregation=plan, ba_loss_config=kl), *MODES["default"])
    batch = _vllm_batch(me, seed=4)
    g = torch.Generator().manual_seed(9)
    old = batch["old_per_token_logps"]
    batch["ref_per_token_logps"] = old - 0.5 * torch.randn(old.shape, generator=g, dtype=old.dtype)
    try:
        loss_ref, g_ref = _gradient(ref, [batch], ga=1, spg=1)
    finally:
        ref.beta = 0.0
    loss_ours, g_ours = _gradient(me, [batch], ga=1, spg=1)
    assert abs(loss_ref - loss_ours) < 1e-12 * abs(loss_ref)
    assert _max_rel_diff(g_ref, g_ours) < 1e-10
    # control: TRL's per-token KL (the k3 of TRL's code) weighted by the ratios as well
    mask = batch["completion_mask"].bool()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = me._get_per_token_logps_and_entropies(me.model, ids, att, MAX_LEN)
    d = batch["ref_per_token_logps"] - logps
    k3 = (d.exp() - d - 1)[mask]
    c = batch["importance_sampling_ratio"].expand(mask.shape)[mask]
    shift = beta * float(((c - 1) * k3).sum()) / int(mask.sum())
    assert abs(shift) > 1e-2 * abs(loss_ref)


def _reference_loss(trainer, batch, weights, mask=None):
    """-J of BA (rule_reference.balanced_objective) on the PPO terms times `weights` over `mask`
    (the completion mask by default), with the float64 log-probs of the trainer's model
    (differentiable)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, MAX_LEN)
    old, adv = batch["old_per_token_logps"], batch["advantages"]
    phi = clipped_terms(logps, old, adv, trainer.epsilon_low, trainer.epsilon_high)
    mask = batch["completion_mask"].bool() if mask is None else mask
    group_ids = torch.arange(len(LENGTHS)) // G
    return -balanced_objective(weights * phi, mask, adv, group_ids)


def _reference_gradient(trainer, batch, weights):
    trainer.model.zero_grad()
    loss = _reference_loss(trainer, batch, weights)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return float(loss.detach()), grads


@pytest.mark.parametrize("case", sorted(MODES))
def test_balanced_with_vllm_is_equals_its_float64_reference(ours, case):
    """aggregation="balanced" (group scope) with TRL's ratios equals BA's definition with each
    token's PPO term times its ratio, masked tokens (ratio 0) still counted in their subset's
    token mean: value and gradient to float64 round-off, in one step and summed over GA shuffled
    micro-batches.

    Negative controls, differing only in where the weight goes: the unweighted BA loss times the
    batch's mean weight (after aggregation), and in the mask modes the tokens TRL zeroes left out
    of the denominators, are each off by > 1%. Seen failing, the trainer changed for the run:
    with each row's mean weight on all its tokens, the token modes' cases; with the plan's lengths
    counting only the tokens a mask mode keeps, the mask modes' cases."""
    mode, clip_min, clip_max = MODES[case]
    no_kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.0)
    plan = dataclasses.replace(ours.ba_aggregation, rule="balanced", scope="group")
    me = _with_vllm(_use(ours, ba_aggregation=plan, ba_loss_config=no_kl), mode, clip_min, clip_max)
    batch = _vllm_batch(me, seed=5)
    _check_ratios_exercise(batch, mode, clip_min, clip_max)
    mask = batch["completion_mask"].bool()
    c = batch["importance_sampling_ratio"].expand(mask.shape).to(torch.float64)
    loss_ref, g_ref = _reference_gradient(me, batch, c)
    loss1, g1 = _gradient(me, [batch], ga=1, spg=1)
    torch.manual_seed(1)
    parts = split_tensor_dict(shuffle_sequence_dict(dict(batch)), GA)
    loss4, g4 = _gradient(me, parts, ga=GA, spg=GA)
    for loss, grads in ((loss1, g1), (loss4, g4)):
        assert abs(loss - loss_ref) < 1e-12 * abs(loss_ref)
        assert _max_rel_diff(g_ref, grads) < 1e-10
    # controls
    c_mean = float(c[mask].mean())
    after = c_mean * float(_reference_loss(me, batch, torch.ones_like(c)).detach())
    assert abs(after - loss_ref) > 1e-2 * abs(loss_ref)
    if mode.endswith("mask"):
        dropped = float(_reference_loss(me, batch, c, mask=mask & (c > 0)).detach())
        assert abs(dropped - loss_ref) > 1e-2 * abs(loss_ref)


def test_missing_ratios_are_named(ours):
    no_kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.0)
    me = _with_vllm(_use(ours, ba_loss_config=no_kl), *MODES["default"])
    batch = _vllm_batch(me)
    del batch["importance_sampling_ratio"]
    with pytest.raises(ValueError, match=r"^inputs\['importance_sampling_ratio'\]: missing"):
        me._compute_loss(me.model, batch)
    batch["importance_sampling_ratio"] = torch.ones(len(LENGTHS), 2)
    with pytest.raises(ValueError, match=r"^inputs\['importance_sampling_ratio'\]: must be"):
        me._compute_loss(me.model, batch)


# --- a Mixture-of-Experts model: TRL's router load-balancing loss --------------------------------


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, model_dir):
    """A tiny Qwen3-MoE (2 experts, top-1 routing, router_aux_loss_coef 0.05) with the tiny Qwen2's
    tokenizer, built here."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        router_aux_loss_coef=0.05,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_moe")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_moe_router_loss_is_added_as_trl_adds_it(moe_dir, tmp_path):
    """With a MoE model TRL enables its router loss (the config's coefficient); our loss adds it as
    TRL does, so aggregation="token" at batch scope equals TRL's `dapo` (value and gradient, the
    router's weights included), in one step and over GA micro-batches (each adds its own
    router loss / GA); and through TRL's own log-prob and router-loss code (float32 log-probs,
    to 1e-6) in one step. Negative control: the same trainer without the router loss differs, and
    the router loss moves the router's weights. Seen failing with the trainer changed to add the
    router loss undivided by the GA steps."""
    ours = _float64_logps(
        _trainer(BalancedGRPOTrainer, moe_dir, tmp_path / "o", extra={"aggregation": "token"})
    )
    theirs = _float64_logps(_trainer(GRPOTrainer, moe_dir, tmp_path / "t"))
    for t in (ours, theirs):  # the grouped-matmul experts take no float64 on CPU
        t.model.config._experts_implementation = "eager"
    assert ours.aux_loss_enabled and ours.router_aux_loss_coef == 0.05
    ours = _use(ours, ba_aggregation=dataclasses.replace(ours.ba_aggregation, scope="batch"))
    ours = _use(ours, ba_loss_config=dataclasses.replace(ours.ba_loss_config, kl_coef=0.0))
    batch = _vllm_batch(ours)  # use_vllm is off: no ratios, the plain GRPO batch
    torch.manual_seed(1)
    parts = split_tensor_dict(shuffle_sequence_dict(dict(batch)), GA)
    for micro, ga in (([batch], 1), (parts, GA)):
        loss_ref, g_ref = _gradient(theirs, [copy.copy(b) for b in micro], ga=ga, spg=ga)
        loss_ours, g_ours = _gradient(ours, micro, ga=ga, spg=ga)
        assert abs(loss_ref - loss_ours) < 1e-12 * abs(loss_ref)
        assert _max_rel_diff(g_ref, g_ours) < 1e-10
    assert ours._metrics["train"]["aux_loss"]
    # TRL's own log-probs and router loss (its fused LM head: float32 log-probs), one step
    for t in (ours, theirs):
        del t._get_per_token_logps_and_entropies
    loss_ref, g_ref = _gradient(theirs, [copy.copy(batch)], ga=1, spg=1)
    loss_ours, g_ours = _gradient(ours, [batch], ga=1, spg=1)
    assert abs(loss_ref - loss_ours) < 1e-6 * abs(loss_ref)
    assert _max_rel_diff(g_ref, g_ours) < 1e-6
    loss0, g0 = _gradient(_use(ours, aux_loss_enabled=False), [batch], ga=1, spg=1)
    loss1, g1 = _gradient(_use(ours, aux_loss_enabled=True), [batch], ga=1, spg=1)
    router = [k for k in g1 if k.endswith("mlp.gate.weight")]
    assert router and abs(loss1 - loss0) > 1e-6 * abs(loss1)
    assert all(float((g1[k] - g0[k]).abs().max()) > 0 for k in router)
