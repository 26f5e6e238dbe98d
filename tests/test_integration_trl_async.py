"""BalancedAsyncGRPOTrainer against TRL's real AsyncGRPOTrainer pieces (CPU, a tiny Qwen2).

No vLLM server and no rollout process: a stub worker puts scored `RolloutSample`s on the queue
(TRL's own tests stub the worker the same way) and a no-op weight transfer stands in for NCCL.
Everything between runs as TRL runs it: the real constructor, RolloutQueueDataset (its staleness
drop), TokenBudgetBatcher / FixedCountBatcher, the tree-packing collator, accelerate's
dispatcher, get_batch_samples and training_step. Replaced: the FA3 kernel of TRL's tree
attention, by a float64 loop with its semantics (each packed segment attends causally to its
root-to-segment path; FA3 needs a GPU), and TRL's fused LM head, whose log-probs are float32, by
a float64 log-softmax of the same packed forward's logits.

The reference is independent of the packing: every sample forwarded alone through a float64
copy of the model (SDPA: eager attention takes its softmax in float32), phi = min(rho A,
clip(rho) A) with rho to the sample's own sampling log-probs, and J_t = sum_i w_i sum_k phi with
w from megatron_ba.step_plan.split_step_weights (checked here against the exact-fraction
definition of tests/test_step_plan.py).
"""

from __future__ import annotations

import queue
import types

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")

from test_step_plan import reference as exact_weights  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, packing  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer as trl_async  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

from megatron_ba.aggregation import sequence_weights  # noqa: E402
from megatron_ba.errors import SettingError  # noqa: E402
from megatron_ba.integrations.trl import BalancedAsyncGRPOTrainer  # noqa: E402
from megatron_ba.integrations.trl.async_trainer import packed_forward_inputs  # noqa: E402
from megatron_ba.step_plan import split_step_weights  # noqa: E402
from megatron_ba.testing.tiny_hf import build_tiny_qwen2  # noqa: E402

G, PROMPT_LEN, CLIP = 4, 4, (0.2, 0.28)
REWARDS = [[1, 0, 1, 0], [0, 0, 1, 0], [1, 1, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0]]
LENGTHS = [[3, 9, 2, 7], [5, 4, 8, 2], [6, 2, 3, 9], [4, 7, 2, 5], [2, 6, 4, 3], [8, 3, 5, 2]]


def _varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, **_):
    """flash_attn_varlen_func's arithmetic on the CPU: segment s's queries attend to keys
    cu_k[s]:cu_k[s+1] (its root-to-segment path), causally aligned to the path's end."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for s in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        ks, vs = k[c:d].repeat_interleave(rep, 1), v[c:d].repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], ks) * softmax_scale
        seen = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + (d - c) - (b - a)
        out[a:b] = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~seen, -torch.inf).softmax(-1), vs
        )
    return out


@pytest.fixture(scope="module", autouse=True)
def _cpu_tree_attention():
    with pytest.MonkeyPatch.context() as mp:
        kernel = types.SimpleNamespace(flash_attn_varlen_func=_varlen_attention)
        mp.setattr(packing, "_flash_attn", lambda: kernel)
        mp.setattr(trl_async, "get_peak_flops_per_device", lambda *a: None)  # no CUDA to ask
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_async"), num_layers=1)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="sdpa"
    )
    return model.eval()


class _Worker:
    """RolloutWorkerProtocol with nothing behind it: the test fills `rollout_buffer`."""

    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()

    def start(self): ...
    def stop(self): ...
    def update_model_version(self, version): ...
    def check_health(self, stale_after_s): ...


class _NoTransfer:
    def init_weight_transfer(self): ...
    def pause(self): ...
    def send_weights(self, iterator): ...
    def resume(self): ...
    def destroy(self): ...


def _float64_logprobs(trainer):
    """The trainer with its packed forward's log-probs taken in float64 from the logits (TRL's
    fused LM head rounds them to float32); the packing, tree attention and loss are unchanged."""

    def term_logprobs(model, inputs, selected):
        forward = packed_forward_inputs(inputs)
        labels = forward.pop("shift_labels")[0]
        logp = model(**forward).logits[0].double().log_softmax(-1)
        where = inputs["token_index"][selected]
        trainer._last_forward_time_s = 0.0  # TRL's throughput accounting reads it
        return logp[where, labels[where]], None

    trainer._term_logprobs = term_logprobs
    return trainer


def _trainer(model_dir, tmp_path, *, aggregation="balanced", **config):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        num_generations=G,
        epsilon=CLIP[0],
        epsilon_high=CLIP[1],
        model_init_kwargs={"dtype": torch.float64},
        **{"gradient_accumulation_steps": 2, "per_device_train_batch_size": G, **config},
    )
    trainer = BalancedAsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=lambda **kwargs: [0.0],  # unused: the stub's samples come scored
        args=args,
        train_dataset=trl_async.Dataset.from_dict({"prompt": ["x"] * 4}),
        rollout_worker=_Worker(),
        weight_transfer=_NoTransfer(),
        aggregation=aggregation,
    )
    return _float64_logprobs(trainer)


def _rollouts(ref_model, group, version, seed):
    """One group scored as TRL's worker scores it (population std, + 1e-8), with sampling
    log-probs of 'version': the current ones moved by noise of that version's seed."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 300, (PROMPT_LEN,), generator=g)
    rewards = np.array(REWARDS[group], dtype=float)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    out = []
    for t, adv in zip(LENGTHS[group], advantages, strict=True):
        ids = torch.cat([prompt, torch.randint(3, 300, (t,), generator=g)])
        with torch.no_grad():
            now = _logps(ref_model, ids)
        old = torch.cat(
            [torch.zeros(PROMPT_LEN), now[PROMPT_LEN - 1 :] + 0.5 * torch.randn(t, generator=g)]
        )
        mask = np.array([0] * PROMPT_LEN + [1] * t)
        out.append(
            RolloutSample(
                [], [], ids.numpy(), mask, old.float().numpy(), float(adv), version, group, {}
            )
        )
    return out


def _logps(model, ids):
    """log pi(ids[p] | ids[:p]) for p >= 1, float64, the sample alone."""
    logits = model(input_ids=ids[None]).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def _feed(trainer, ref_model, plan):
    """Put the groups of `plan` ([(group, version)]) on the queue, then filler groups so that
    the batcher can close the last micro-batch the step needs. Returns {group: samples}."""
    groups = {}
    for i, (group, version) in enumerate(plan + [(4, 9), (5, 9)] * 2):
        samples = _rollouts(ref_model, group, version, seed=10 * group + version)
        if i < len(plan):
            groups[group] = samples
        for s in samples:
            trainer.rollout_worker.rollout_buffer.put(s)
    return groups


def _step(trainer):
    """One optimiser step's loss and gradients through TRL's real data path, and the samples
    its micro-batches held (recorded at the collator; the dispatcher may collate one ahead)."""
    loader = trainer.get_train_dataloader()
    base = getattr(loader, "base_dataloader", loader)
    calls, collate = [], base.collate_fn

    def recording(examples):
        calls.append([s for row in examples[0] for s in row.samples])
        return collate(examples)

    base.collate_fn = recording
    trainer.model.train()
    trainer.model.zero_grad()
    ga = trainer.args.gradient_accumulation_steps
    batches, n = trainer.get_batch_samples(iter(loader), ga, trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(batches)
    loss = sum(trainer.training_step(trainer.model, b, n) for b in batches)
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    held = {_key(s) for c in calls[: len(batches)] for s in c}
    return loss, grads, held, batches


def _key(sample) -> tuple:
    ids = sample["input_ids"] if isinstance(sample, dict) else sample.input_ids
    return tuple(int(x) for x in ids)


def _step_rows(groups, held):
    """Every sequence of the groups the step touches, in group order, with its step flag."""
    touched = sorted({g for g, ss in groups.items() for s in ss if _key(s) in held})
    rows = [s for g in touched for s in groups[g]]
    lengths = torch.tensor([float(s.completion_mask[1:].sum()) for s in rows], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in rows], dtype=torch.float64)
    ids = torch.tensor([s.group_id for s in rows])
    in_step = torch.tensor([_key(s) in held for s in rows])
    return rows, lengths, adv, ids, in_step


def _objective(ref_model, rows, weights, *, ratio=True):
    """-sum_i w_i sum_k phi_{i,k} in float64, each sample forwarded alone; its gradient."""
    total = torch.zeros((), dtype=torch.float64)
    for s, w in zip(rows, weights.tolist(), strict=True):
        if w == 0:
            continue
        ids = torch.as_tensor(s.input_ids)
        logp = _logps(ref_model, ids)
        old = torch.as_tensor(s.old_log_probs[1:]).double() if ratio else logp.detach()
        rho = (logp - old).exp()
        phi = torch.minimum(rho * s.advantage, rho.clamp(1 - CLIP[0], 1 + CLIP[1]) * s.advantage)
        total = total + w * phi[torch.as_tensor(s.completion_mask[1:]).bool()].sum()
    loss = -total
    ref_model.zero_grad()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in ref_model.named_parameters()}


def _assert_matches(loss, grads, ref_loss, ref_grads):
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-10, abs=1e-13)
    for name, grad in ref_grads.items():
        # Every weight agrees to ~1e-16; the (tied) embedding's gradient to ~1e-7 of its largest
        # entry (an unexplained float32-sized rounding in the packed path's embedding backward).
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-7 * scale)


def _held_weights(batches, calls):
    """{sample key: the weight the trainer gave its terms}, read off the packed batches."""
    out = {}
    for batch, samples in zip(batches, calls, strict=False):
        valid = batch["token_index"][0] >= 0
        segments, weights = batch["segment_id"][0][valid], batch["ba_weights"][0][valid]
        for seg, w in zip(segments.tolist(), weights.tolist(), strict=True):
            out.setdefault(_key(samples[seg]), set()).add(w)
    assert all(len(ws) == 1 for ws in out.values())  # one weight per sample, on all its terms
    return {k: ws.pop() for k, ws in out.items()}


@pytest.fixture(scope="module")
def split(model_dir, ref_model, tmp_path_factory):
    """A TokenBudgetBatcher step that holds group 0 whole, over two micro-batches, and only the
    first completion of group 1 (budget 24 unique tokens per row, two micro-batches per step)."""
    trainer = _trainer(model_dir, tmp_path_factory.mktemp("split"), token_budget=24)
    groups = _feed(trainer, ref_model, [(0, 0), (1, 0), (2, 0)])
    loss, grads, held, _ = _step(trainer)
    rows, lengths, adv, ids, in_step = _step_rows(groups, held)
    return types.SimpleNamespace(
        trainer=trainer, loss=loss, grads=grads, rows=rows, lengths=lengths, adv=adv, ids=ids,
        in_step=in_step,
    )  # fmt: skip


def test_a_split_group_step_equals_the_float64_reference(split, ref_model):
    """(a) loss and gradients of a step holding 1 + 1/4 groups = -sum w_i sum phi, w from
    split_step_weights (Gamma_t = 1.25), which equals the exact-fraction definition."""
    s = split
    held_per_group = [int(s.in_step[s.ids == g].sum()) for g in s.ids.unique()]
    assert held_per_group == [4, 1]  # group 1 cut between this step and the next
    assert split.trainer._metrics["train"]["ba/step_groups"] == [1.25]
    w = split_step_weights("balanced", s.lengths, s.adv, s.ids, s.in_step)
    exact = exact_weights(
        "balanced", s.lengths.tolist(), s.adv.tolist(), s.ids.tolist(), s.in_step.tolist()
    )
    assert w.tolist() == pytest.approx([float(x) for x in exact], rel=1e-12, abs=0)
    ref_loss, ref_grads = _objective(ref_model, s.rows, w)
    _assert_matches(s.loss, s.grads, ref_loss, ref_grads)


def test_d_control_per_part_statistics_differ(split, ref_model):
    """(d) the same step planned from its parts' own statistics and normalised per step (a
    per-batch plan of the cut batch: group 1's part alone is a group of one) is another loss."""
    s = split
    naive = torch.zeros_like(s.lengths)
    naive[s.in_step] = sequence_weights(
        "balanced", s.lengths[s.in_step], s.adv[s.in_step], s.ids[s.in_step]
    )
    naive_loss, _ = _objective(ref_model, s.rows, naive)
    assert abs(float(naive_loss) - float(s.loss)) > 1e-3 * abs(float(s.loss))


def test_e_the_ratio_to_each_samples_sampler_is_in_phi(split, ref_model):
    """(e) AsyncGRPOTrainer's only rollout correction is rho against the sampling log-probs that
    came with each sample (vLLM's, of its version), clipped: the trainer keeps it. The clip
    binds on some tokens here; with rho = 1 (the correction dropped) the loss differs."""
    s = split
    metrics = s.trainer._metrics["train"]
    clipped = metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"]
    assert sum(n for n, _ in clipped) > 0
    w = split_step_weights("balanced", s.lengths, s.adv, s.ids, s.in_step)
    uncorrected, _ = _objective(ref_model, s.rows, w, ratio=False)
    assert abs(float(uncorrected) - float(s.loss)) > 1e-3 * abs(float(s.loss))


def _whole_group_step(model_dir, ref_model, tmp_path, feed, **config):
    """A FixedCountBatcher step (one group per micro-batch) after policy version 1 is live."""
    trainer = _trainer(model_dir, tmp_path, token_budget=0, **config)
    trainer.model_version = 1
    groups = _feed(trainer, ref_model, feed)
    loss, grads, held, batches = _step(trainer)
    return trainer, groups, loss, grads, held, batches


def test_b_a_step_of_two_policy_versions_is_todays_plan(model_dir, ref_model, tmp_path):
    """(b) groups sampled by versions 0 and 1 in one step: the plan never reads the version
    (today's sequence_weights on the step), each sample's ratio is to its own sampler."""
    feed = [(2, 0), (3, 1)]
    _, groups, loss, grads, held, _ = _whole_group_step(
        model_dir, ref_model, tmp_path, feed, max_staleness=1
    )
    rows, lengths, adv, ids, in_step = _step_rows(groups, held)
    assert {s.model_version for s in rows if _key(s) in held} == {0, 1}
    assert bool(in_step.all())
    w = sequence_weights("balanced", lengths, adv, ids)
    _assert_matches(loss, grads, *_objective(ref_model, rows, w))


def test_c_max_staleness_0_gives_the_synchronous_plan_exactly(model_dir, ref_model, tmp_path):
    """(c) max_staleness=0 drops version 0's groups; the step of version 1's whole groups has
    exactly today's weights (bit for bit) and the loss of the synchronous plan."""
    feed = [(0, 0), (1, 1), (2, 0), (3, 1)]
    trainer, groups, loss, grads, held, batches = _whole_group_step(
        model_dir, ref_model, tmp_path, feed, max_staleness=0
    )
    assert len(trainer._metrics["train"]["sample/dropped_stale_total"]) == 2 * G
    rows, lengths, adv, ids, in_step = _step_rows(groups, held)
    assert sorted(set(ids.tolist())) == [1, 3] and bool(in_step.all())
    today = sequence_weights("balanced", lengths, adv, ids)
    calls = [[s for s in rows if s.group_id == g] for g in (1, 3)]
    got = _held_weights(batches, [[{"input_ids": s.input_ids} for s in c] for c in calls])
    assert [got[_key(s)] for s in rows] == today.tolist()
    _assert_matches(loss, grads, *_objective(ref_model, rows, today))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tools": [len]}, "tools"),
        ({"environment_factory": object}, "environment_factory"),
        ({"scope": "batch"}, "scope"),
        ({"aggregation": "dr_grpo"}, "aggregation"),
        ({"aggregation": "mean"}, "aggregation"),
    ],
)
def test_what_the_plan_cannot_honour_is_refused_by_name(model_dir, tmp_path, kwargs, name):
    with pytest.raises(SettingError, match=rf"^{name}: "):
        BalancedAsyncGRPOTrainer(model=str(model_dir), args=None, **kwargs)
