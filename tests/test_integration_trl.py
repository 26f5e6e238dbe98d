"""BalancedGRPOTrainer against the real `trl` package (CPU, a tiny Qwen2 built here).

- it trains a few steps end to end (TRL's own transformers generation) and logs the diagnostics;
- the gradient under gradient accumulation equals the one-step gradient, for the core's rules;
  negative control: TRL's `bnpo` (a per-micro-batch token mean) does not add up;
- TRL's `dapo` / `grpo` / `dr_grpo` equal the core's token / sequence / dr_grpo rules where their
  definitions agree (batch scope, equal group sizes), and `grpo` differs from `token` (control);
- `aggregation="group_token_mean"` equals its float64 definition (tests/rule_reference.py), in
  one step and over accumulation steps; the pooled batch token mean differs (control).
vLLM's importance-sampling correction and a MoE router loss: tests/test_integration_trl_is.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from rule_reference import (  # noqa: E402
    clipped_terms,
    group_token_mean_objective,
    group_token_mean_weights,
)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402

from megatron_ba.aggregation import sequence_weights  # noqa: E402
from megatron_ba.integrations.trl import BalancedGRPOTrainer  # noqa: E402
from megatron_ba.loss_settings import AggregationSettings  # noqa: E402
from megatron_ba.parallel.collectives import StatisticsReducer  # noqa: E402
from megatron_ba.testing.tiny_hf import build_tiny_qwen2  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
G, NUM_PROMPTS, MAX_LEN, PROMPT_LEN, GA = 4, 2, 6, 3, 4


def _doc_snippet(name: str) -> str:
    """The ```python block of docs/integrations.md that starts with `# docs snippet: NAME`."""
    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    start = text.index(f"```python\n# docs snippet: {name}\n") + len("```python\n")
    return text[start : text.index("```", start)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), num_layers=1)


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=GA,
        num_generations=G,
        max_completion_length=MAX_LEN,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        epsilon=0.2,
        epsilon_high=0.28,
        use_bias_correction_kl=False,
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _reward(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def _trainer(cls, model_dir, tmp_path, *, extra=None, dtype=torch.float64, **config):
    tok = AutoTokenizer.from_pretrained(model_dir)
    # float64 so that equalities are tested tightly (Qwen2's RMSNorm still rounds through
    # float32, which bounds the agreement at ~1e-7); the training test runs in float32.
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(dtype)
    ds = Dataset.from_dict({"prompt": [f"What is {i} + {i}?" for i in range(16)]})
    return cls(
        model=model,
        reward_funcs=_reward,
        args=_config(tmp_path, **config),
        train_dataset=ds,
        processing_class=tok,
        **(extra or {}),
    )


@pytest.fixture(scope="module")
def ours(model_dir, tmp_path_factory):
    """One BalancedGRPOTrainer (float64) for the numerical tests; they switch its rule."""
    return _trainer(BalancedGRPOTrainer, model_dir, tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module")
def theirs(model_dir, tmp_path_factory):
    """One plain trl.GRPOTrainer (float64) with the same weights; tests switch its loss_type."""
    return _trainer(GRPOTrainer, model_dir, tmp_path_factory.mktemp("theirs"))


def _use(trainer, **attributes):
    for k, v in attributes.items():
        setattr(trainer, k, v)
    return trainer


def _generation_batch(seed=0):
    """A scored generation batch as TRL builds it, with varied completion lengths and old
    log-probs off the current policy (so clipping is active)."""
    g = torch.Generator().manual_seed(seed)
    n = G * NUM_PROMPTS
    lengths = torch.tensor([1, 6, 2, 5, 3, 3, 6, 4])
    completion_mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    grouped = rewards.view(-1, G)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    return {
        "prompt_ids": torch.randint(3, 400, (n, PROMPT_LEN), generator=g),
        "prompt_mask": torch.ones(n, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(3, 400, (n, MAX_LEN), generator=g),
        "completion_mask": completion_mask,
        "advantages": adv.reshape(-1),
        "num_items_in_batch": completion_mask.sum(),
        "_noise": 0.3 * torch.randn(n, MAX_LEN, generator=g, dtype=torch.float64),
    }


def _with_old_logps(trainer, batch):
    """old log-probs = current ones + fixed noise; ref log-probs = current - noise/2."""
    out = {k: v for k, v in batch.items() if k != "_noise"}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, MAX_LEN)
    out["old_per_token_logps"] = logps + batch["_noise"]
    out["ref_per_token_logps"] = logps - 0.5 * batch["_noise"]
    return out


def _gradient(trainer, batches, *, ga, spg):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = ga
    trainer.args.steps_per_generation = spg
    total = 0.0
    for b in batches:
        loss = trainer._compute_loss(trainer.model, b)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return total, grads


def _one_step_and_accumulated(trainer, batch):
    """(loss, grads) of the whole generation batch in one step, and in GA micro-batches."""
    one = _gradient(trainer, [batch], ga=1, spg=1)
    torch.manual_seed(1)
    parts = split_tensor_dict(shuffle_sequence_dict(dict(batch)), GA)
    acc = _gradient(trainer, parts, ga=GA, spg=GA)
    return one, acc


def _max_rel_diff(a, b):
    """||a - b|| / ||a|| over all parameters' gradients."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].pow(2).sum()) for k in a)) ** 0.5


def test_docs_snippet_trains_a_few_steps_and_logs_diagnostics(tmp_path):
    """The TRL snippet of docs/integrations.md, as written: two steps with real TRL generation."""
    code = _doc_snippet("trl").replace("trainer.train()\n", "")
    namespace = {"work_dir": tmp_path}
    exec(compile(code, "docs/integrations.md", "exec"), namespace)
    trainer = namespace["trainer"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert all(k in h for k in ("ba/balanced/weight_share_pos", "ba/length_gap_pos_minus_neg"))
        assert torch.isfinite(torch.tensor(h["loss"]))
    params = trainer.model.named_parameters()
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in params)
    assert moved > 0


@pytest.mark.parametrize("rule", ["balanced", "token", "sequence"])
def test_accumulated_gradient_equals_one_step(ours, rule):
    # with a KL term (the core's k3, aggregated by the regulariser plan)
    kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.04)
    plan = dataclasses.replace(ours.ba_aggregation, rule=rule, scope="group")
    trainer = _use(ours, ba_aggregation=plan, ba_loss_config=kl)
    batch = trainer.attach_plan(_with_old_logps(trainer, _generation_batch()))
    # The attached plan is the core's, computed on the whole generation batch.
    group_ids = torch.arange(G * NUM_PROMPTS) // G
    lengths = batch["completion_mask"].sum(1)
    expected = sequence_weights(rule, lengths, batch["advantages"].double(), group_ids)
    torch.testing.assert_close(batch["ba_weights"], expected, rtol=1e-12, atol=0)
    (loss1, g1), (loss4, g4) = _one_step_and_accumulated(trainer, batch)
    assert abs(loss1 - loss4) < 1e-9
    assert _max_rel_diff(g1, g4) < 1e-6


def test_group_token_mean_equals_its_float64_reference(ours):
    """aggregation="group_token_mean" (at scope="batch": the rule is per prompt whatever the scope)
    attaches 1 / (Gamma N_g) and trains on minus the mean over prompts of each prompt's token mean
    of the PPO term, in one step and over GA micro-batches. Control: the same definition with the
    batch as one group (TRL's `dapo`, the batch token mean) is another loss on this batch."""
    no_kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.0)
    plan = dataclasses.replace(ours.ba_aggregation, rule="group_token_mean", scope="batch")
    trainer = _use(ours, ba_aggregation=plan, ba_loss_config=no_kl)
    batch = trainer.attach_plan(_with_old_logps(trainer, _generation_batch()))
    mask = batch["completion_mask"].bool()
    group_ids = torch.arange(G * NUM_PROMPTS) // G
    expected = group_token_mean_weights(mask.sum(1), group_ids)
    torch.testing.assert_close(batch["ba_weights"], expected, rtol=1e-12, atol=0)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, MAX_LEN)
    phi = clipped_terms(
        logps,
        batch["old_per_token_logps"],
        batch["advantages"],
        ours.epsilon_low,
        ours.epsilon_high,
    )
    ref = -float(group_token_mean_objective(phi, mask, group_ids))
    pooled = -float(group_token_mean_objective(phi, mask, torch.zeros_like(group_ids)))
    (loss1, g1), (loss4, g4) = _one_step_and_accumulated(trainer, batch)
    # TRL's log-probs are float32 (so is the loss computed from them): float32 rounding, 1e-6
    assert abs(loss1 - ref) < 1e-6 * abs(ref) and abs(loss4 - ref) < 1e-6 * abs(ref)
    assert abs(pooled - ref) > 1e-3 * abs(ref)
    assert _max_rel_diff(g1, g4) < 1e-6


def test_trl_bnpo_accumulation_does_not_add_up(theirs):
    """Negative control: TRL's per-micro-batch token mean differs from its one-step value,
    while TRL's `dapo` (normalised by the generation batch's token count) adds up."""
    bnpo = _use(theirs, loss_type="bnpo")
    batch = _with_old_logps(bnpo, _generation_batch())
    (_, g1), (_, g4) = _one_step_and_accumulated(bnpo, batch)
    assert _max_rel_diff(g1, g4) > 1e-2
    dapo = _use(theirs, loss_type="dapo")
    (_, g1), (_, g4) = _one_step_and_accumulated(dapo, batch)
    assert _max_rel_diff(g1, g4) < 1e-6


@pytest.mark.parametrize(
    ("trl_loss", "rule", "same"),
    [
        ("dapo", "token", True),
        ("grpo", "sequence", True),
        ("dr_grpo", "dr_grpo", True),
        ("grpo", "token", False),
    ],
)
def test_trl_loss_types_match_core_rules(ours, theirs, trl_loss, rule, same):
    ref = _use(theirs, loss_type=trl_loss)
    no_kl = dataclasses.replace(ours.ba_loss_config, kl_coef=0.0)  # TRL's beta is 0 here
    plan = dataclasses.replace(ours.ba_aggregation, rule=rule, scope="batch")
    ours = _use(ours, ba_aggregation=plan, ba_loss_config=no_kl)
    batch = _with_old_logps(ref, _generation_batch(seed=3))
    loss_ref, g_ref = _gradient(ref, [batch], ga=1, spg=1)
    loss_ours, g_ours = _gradient(ours, [ours.attach_plan(copy.copy(batch))], ga=1, spg=1)
    if same:
        assert abs(loss_ref - loss_ours) < 1e-6 * max(1.0, abs(loss_ref))
        assert _max_rel_diff(g_ref, g_ours) < 1e-6
    else:
        assert _max_rel_diff(g_ref, g_ours) > 1e-2


# --- two processes (gloo): the plan of each process's share is the single-process plan ----------

PROCS, ROWS = 2, 16  # 4 groups of G=4, 8 completions per process


def _two_process_batch():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, MAX_LEN + 1, (ROWS,), generator=g)
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).long()
    adv = torch.randn(ROWS, generator=g)
    adv[: G // 2] = 0.0  # some neutral responses
    return mask, adv


def _plan_worker(rank: int, store: str, out_dir: str, reduce: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=PROCS)
    try:
        mask, adv = _two_process_batch()
        rows = slice(rank * ROWS // PROCS, (rank + 1) * ROWS // PROCS)
        out = {}
        for rule in ("balanced", "balanced_mass", "token", "sequence", "group_token_mean"):
            # The trainer's attributes that attach_plan reads; TRL's accelerator in 2 processes.
            me = types.SimpleNamespace(
                accelerator=types.SimpleNamespace(process_index=rank, num_processes=PROCS),
                num_generations=G,
                num_generations_eval=G,
                ba_aggregation=AggregationSettings(
                    rule, scope="group", reg_rule="token", reg_scope="batch", max_length=MAX_LEN
                ),
                ba_reducer=StatisticsReducer(group=dist.group.WORLD if reduce else None),
                _metrics={"train": defaultdict(list)},
            )
            me._log_plan_diagnostics = types.MethodType(
                BalancedGRPOTrainer._log_plan_diagnostics, me
            )
            batch = {"completion_mask": mask[rows], "advantages": adv[rows]}
            BalancedGRPOTrainer.attach_plan(me, batch, "train")
            out[rule] = batch["ba_weights"].tolist()
            out[f"{rule}/num_sequences"] = me._metrics["train"]["ba/num_sequences"][0]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_plan_across_two_processes_equals_single_process(tmp_path):
    mask, adv = _two_process_batch()
    group_ids = torch.arange(ROWS) // G
    for reduce in (True, False):  # False: the negative control, each process plans alone
        run = tmp_path / str(reduce)
        run.mkdir()
        # fork: the children inherit the imported trl/transformers instead of importing them again
        mp.start_processes(
            _plan_worker,
            args=(str(run / "store"), str(run), reduce),
            nprocs=PROCS,
            start_method="fork",
        )
        parts = [json.loads((run / f"rank{r}.json").read_text()) for r in range(PROCS)]
        for rule in ("balanced", "balanced_mass", "token", "sequence", "group_token_mean"):
            got = torch.tensor(parts[0][rule] + parts[1][rule], dtype=torch.float64)
            want = sequence_weights(rule, mask.sum(1), adv.double(), group_ids)
            if reduce:
                torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
                assert all(p[f"{rule}/num_sequences"] == ROWS for p in parts)
            else:
                assert float((got - want).abs().max()) > 1e-3 * float(want.abs().max())


# GRPOConfig settings whose effect BalancedGRPOTrainer's loss would drop: each must be refused,
# naming the setting (argument overrides, fragment of the error).
IGNORED_SETTINGS = {
    **{f"loss_type_{t}": ({"loss_type": t}, "args.loss_type") for t in
       ("grpo", "bnpo", "dr_grpo", "sapo", "cispo", "vespo")},
    "sequence_ratios": ({"importance_sampling_level": "sequence"},
                        "args.importance_sampling_level"),
    "entropy_mask": ({"top_entropy_quantile": 0.5}, "args.top_entropy_quantile"),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.5}, "args.off_policy_mask_threshold"),
    "two_sided_clip": ({"delta": 2.0}, "args.delta"),
    "trl_entropy_bonus": ({"entropy_coef": 0.01}, "args.entropy_coef"),
    "kl_bias_correction": ({"beta": 0.04, "use_bias_correction_kl": True},
                           "args.use_bias_correction_kl"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(IGNORED_SETTINGS))
def test_settings_the_loss_would_ignore_are_refused(model_dir, tmp_path, case):
    overrides, fragment = IGNORED_SETTINGS[case]
    with pytest.raises(ValueError, match=rf"^{fragment.replace('.', '[.]')}: ") as err:
        _trainer(BalancedGRPOTrainer, model_dir, tmp_path, dtype=torch.float32, **overrides)
    assert "BalancedGRPOTrainer" in str(err.value)


def test_default_loss_type_and_settings_are_accepted(ours):
    assert ours.args.loss_type == "dapo" and not ours.aux_loss_enabled
