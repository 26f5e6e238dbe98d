"""BalancedPGLossFn through NeMo-RL's own training step (worker_loop.py), on 2 data-parallel gloo
processes, for plain micro-batches, dynamic batching and sequence packing.

Per layout, one global batch of 4 prompts x 4 responses (a filtered response included):
- `ba_rule=token, ba_scope=batch` gives NeMo-RL's ClippedPGLossFn's loss and gradient (its own
  normalisation: the global token mean);
- `balanced` and `group_token_mean` give a float64 single-process reference (reference.py) of the
  same model, to float32 round-off (the step computes log-probs in float32);
- negative control: the plan attached to each DP shard (instead of the global batch) does not.

Two optimizer steps per rollout batch (train_global_batch_size = half the batch, 2 prompts each):
NeMo-RL's sharding gives each step one consecutive half (checked on the rows each rank's global
batch holds), and each step with BalancedPGLossFn(step_size=8) is the float64 reference of its
own half; the control, the whole batch's plan, is off by its group count.
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

import torch
import torch.multiprocessing as mp
from reference import importance_weights, plan_weights, reference_loss

G, PROMPTS, PROMPT, SEQ, VOCAB, DP = 4, 4, 3, 14, 13, 2
STEP = 2 * G  # rows of one optimizer step in the two-step cases
LOSS_CFG = {
    "reference_policy_kl_penalty": 0.05,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "ratio_clip_c": 3.0,
}
# NeMo-RL's truncated importance sampling (TIS), for the cases named "..._tis"
TIS = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
       "truncated_importance_sampling_ratio": 1.2}  # fmt: skip
LAYOUTS = ("plain", "dynamic", "packed")
# (loss function, rule): what each rank trains with in every layout
CASES = (
    *(("clipped", None), ("balanced", "token"), ("balanced", "balanced")),
    *(("balanced", "group_token_mean"), ("per_shard_plan", "balanced")),
    *(("clipped_tis", None), ("balanced_tis", "token"), ("balanced_tis", "balanced")),
)


def batch():
    """The global batch as GRPO's train_data holds it (float32, NeMo-RL's dtypes)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    n = G * PROMPTS
    resp = torch.randint(1, SEQ - PROMPT + 1, (n,), generator=g)
    lengths = PROMPT + resp
    pos = torch.arange(SEQ)[None, :]
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    grouped = rewards.view(-1, G)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    sample_mask = torch.ones(n)
    sample_mask[6] = 0.0
    rand = lambda: -torch.rand(n, SEQ, generator=g)  # noqa: E731
    return BatchedDataDict({
        "input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g) * (pos < lengths[:, None]),
        "input_lengths": lengths,
        "token_mask": ((pos >= PROMPT) & (pos < lengths[:, None])).float(),
        "sample_mask": sample_mask,
        "advantages": adv.reshape(-1)[:, None].expand(n, SEQ).clone(),
        "prev_logprobs": rand(),
        "generation_logprobs": rand(),
        "reference_policy_logprobs": rand(),
    })  # fmt: skip


def _loss_fn(kind, rule):
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn

    from megatron_ba.integrations.nemo_rl import BalancedPGLossFn

    cfg = LOSS_CFG | (TIS if kind.endswith("_tis") else {})
    if kind.startswith("clipped"):
        return ClippedPGLossFn(ClippedPGLossConfig(**cfg))
    scope = {"ba_scope": "batch"} if rule == "token" else {}
    return BalancedPGLossFn(cfg | {"ba_rule": rule} | scope, group_size=G)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from worker_loop import TokenModel, policy_config, step_rows, train_step

    from megatron_ba.integrations.nemo_rl import BalancedPGLossFn

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=DP)  # fmt: skip
    results = {}
    for layout in LAYOUTS:
        for kind, rule in CASES:
            data, loss_fn = batch(), _loss_fn(kind, rule)
            if kind.startswith("balanced"):
                loss_fn.attach_plan(data)  # the global batch, as run_grpo_balanced does
            elif kind == "per_shard_plan":  # control: each rank plans its own half
                half = data.size // DP
                weights = torch.zeros(data.size, dtype=torch.float64)
                for part in range(DP):
                    shard = data.slice(part * half, (part + 1) * half)
                    loss_fn.attach_plan(shard)
                    weights[part * half : (part + 1) * half] = shard["ba_weights"]
                data["ba_weights"] = weights
            grads, loss, _ = train_step(
                TokenModel(VOCAB), data, loss_fn, policy_config(layout), rank, DP
            )
            results[layout, kind, rule] = (loss, grads[0])
    for layout in LAYOUTS:  # two optimizer steps per rollout batch
        data, loss_fn = batch(), _loss_fn("balanced", "balanced")
        data["row"] = torch.arange(data.size)
        stepped = BalancedPGLossFn(LOSS_CFG | {"ba_rule": "balanced"}, group_size=G, step_size=STEP)
        for kind, fn in (("steps", stepped), ("steps_whole_plan", loss_fn)):
            fn.attach_plan(data)
            for step in range(2):
                grads, loss, _ = train_step(
                    TokenModel(VOCAB), data, fn, policy_config(layout), rank, DP, steps=2, step=step
                )
                rows = step_rows(data, policy_config(layout), rank, DP, steps=2, step=step)
                results[layout, kind, step] = (loss, grads[0], rows)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp") / "results.pt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(_free_port(), out), nprocs=DP, start_method="spawn")
    return torch.load(out)


def _reference(rule: str, tis: bool = False, rows: slice = slice(None)):
    """Loss and gradient of the whole batch (or its `rows`) in one process, float64 (with
    NeMo-RL's TIS weights on each token's term when `tis`)."""
    from worker_loop import TokenModel

    data = batch().slice(rows.start or 0, rows.stop or G * PROMPTS)
    model = TokenModel(VOCAB, dtype=torch.float64)
    logits = model(data["input_ids"])
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, data["input_ids"][:, 1:, None])[
        ..., 0
    ]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    weights = plan_weights(rule, mask.sum(1), data["advantages"][:, -1], G)
    data64 = {k: v.double() for k, v in data.items()}
    c = importance_weights(data64, "tis", None, 1.2) if tis else None
    loss = reference_loss(logp, data64, weights, dual_clip=3.0, kl=0.05, is_weights=c)
    (grad,) = torch.autograd.grad(loss, model.table)
    return loss.detach(), grad


def _close(got, want, rtol):
    loss, grad = got
    ref_loss, ref_grad = want
    assert abs(float(loss) - float(ref_loss)) <= rtol * abs(float(ref_loss)), (loss, ref_loss)
    err = float((grad.double() - ref_grad.double()).norm() / ref_grad.double().norm())
    assert err <= rtol, err


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_rule_at_batch_scope_is_nemo_rls_loss_in_its_step(results, layout):
    _close(results[layout, "balanced", "token"], results[layout, "clipped", None], 1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rule", ["balanced", "group_token_mean"])
def test_step_equals_the_float64_reference(results, layout, rule):
    _close(results[layout, "balanced", rule], _reference(rule), 1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_per_dp_shard_does_not(results, layout):
    """Control: the same step with each rank's plan built from its own shard."""
    loss, grad = results[layout, "per_shard_plan", "balanced"]
    ref_loss, ref_grad = _reference("balanced")
    assert abs(float(loss) - float(ref_loss)) > 1e-3 * abs(float(ref_loss))
    assert float((grad.double() - ref_grad).norm() / ref_grad.norm()) > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_nemo_rls_truncated_importance_sampling(results, layout):
    """NeMo-RL's TIS on: the token rule is still ClippedPGLossFn in its step, BA is the float64
    reference with the same per-token weights, and BA without them (control) is not."""
    tis = results[layout, "balanced_tis", "balanced"]
    _close(results[layout, "balanced_tis", "token"], results[layout, "clipped_tis", None], 1e-6)
    _close(tis, _reference("balanced", tis=True), 1e-5)
    assert abs(float(tis[0]) - float(_reference("balanced")[0])) > 1e-3 * abs(float(tis[0]))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_optimizer_step_holds_a_consecutive_chunk_and_its_own_plan(results, layout):
    """Two steps per rollout batch: NeMo-RL gives step j rows [8j, 8j + 8) (whole groups, on
    each DP rank), and each step is the float64 reference of its own rows; the whole batch's
    plan there (the control) is half the loss: its group count is 4, a step's 2."""
    for step in range(2):
        rows = slice(step * STEP, (step + 1) * STEP)
        loss, grad, seen = results[layout, "steps", step]
        assert set(seen) <= set(range(rows.start, rows.stop)) and len(seen) == STEP // DP
        _close((loss, grad), _reference("balanced", rows=rows), 1e-5)
        whole_loss = results[layout, "steps_whole_plan", step][0]
        ref_loss = float(_reference("balanced", rows=rows)[0])
        assert abs(float(whole_loss) - ref_loss) > 1e-3 * abs(ref_loss)
