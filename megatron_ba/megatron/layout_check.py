"""Check that a TP x PP x CP x DP layout gives the single-process loss and gradients exactly.

    from megatron_ba.megatron.layout_check import Layout, Case, run_layout
    results = run_layout(Layout(tp=2, pp=1, cp=1, dp=2), [Case("balanced", 3)], seed=0)

One launch of tp*pp*cp*dp gloo processes (torch.multiprocessing, spawn) runs every case of the
list; one single-process launch computes the reference (TP=PP=CP=DP=1, one micro-batch) first.
Each side starts from the same full weights (model.full_init_state_dict) and the same synthetic
GRPO batch (`synthetic_batch`): groups split across DP ranks, binary rewards, wrong answers longer
than right ones (uneven, sign-correlated lengths), one zero-variance group, old and reference
log-probs near the model's (so that clipping, dual clipping, KL and entropy all act).

Errors (float32 runs):
  max_rel_grad_err = max over parameters of max|g - g_ref| / max|g_ref| (each gathered to full
                     shape), loss_err = |L - L_ref| (absolute: a balanced loss is near 0).
CP runs at the loss level on CPU (grpo_step's cp_mode="loss"): the model sees whole sequences.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass

import torch

from megatron_ba.loss import GRPOLossConfig

TOLERANCE = 1e-5
LOSS_CONFIG = GRPOLossConfig(
    clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01
)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xCP{self.cp}xDP{self.dp}"


@dataclass(frozen=True)
class Case:
    rule: str
    num_microbatches: int = 1
    scope: str = "group"
    per_token_loss: bool = False
    normalization: str = "plan"  # "per_microbatch": the negative control (must fail)
    # Negative control of the scaling: cancel another megatron-core version's factors.
    assume_megatron_version: tuple[int, int] | None = None

    def __str__(self) -> str:
        extra = " per-token" if self.per_token_loss else ""
        extra += " PER-MICROBATCH-NORMALISED" if self.normalization != "plan" else ""
        if self.assume_megatron_version is not None:
            major, minor = self.assume_megatron_version
            extra += f" SCALED-AS-{major}.{minor}"
        return f"{self.rule}/{self.scope} M={self.num_microbatches}{extra}"


@dataclass
class CaseResult:
    case: Case
    max_rel_grad_err: float
    loss_err: float
    loss: float
    loss_ref: float
    reducer_calls: list[int]  # per rank, in global rank order

    @property
    def ok(self) -> bool:
        return self.max_rel_grad_err <= TOLERANCE and self.loss_err <= TOLERANCE


NUM_GROUPS, GROUP_SIZE = 4, 3
REWARDS = [[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]]  # group 3: zero variance


def _spec():
    from megatron_ba.megatron.model import tiny_qwen2_spec

    return tiny_qwen2_spec()


def check_layout_possible(layout: Layout, cases: list[Case], world_size: int | None = None) -> None:
    """ValueError saying why a layout (or a case on it) cannot be built."""
    for name in ("tp", "pp", "cp", "dp"):
        v = getattr(layout, name)
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"--{name}: must be an integer >= 1, got {v!r}")
    if world_size is not None and world_size != layout.world:
        raise ValueError(f"world size {world_size} != tp*pp*cp*dp = {layout.world}")
    _spec().check_layout(layout.tp, layout.pp)
    n = NUM_GROUPS * GROUP_SIZE
    if n % layout.dp:
        raise ValueError(f"--dp: {layout.dp} does not divide the batch's {n} sequences")
    for case in cases:
        if (n // layout.dp) % case.num_microbatches:
            raise ValueError(
                f"--micro-batches: {case.num_microbatches} does not divide the {n // layout.dp} "
                f"sequences each of the {layout.dp} DP ranks holds"
            )


def synthetic_batch(seed: int) -> dict[str, torch.Tensor]:
    """The global batch (without log-probs): rows grouped by prompt, 4 groups of 3."""
    g = torch.Generator().manual_seed(seed)
    spec = _spec()
    rewards = torch.tensor(REWARDS, dtype=torch.float64).reshape(-1)
    group_ids = torch.arange(NUM_GROUPS).repeat_interleave(GROUP_SIZE)
    right = torch.randint(2, 6, (rewards.numel(),), generator=g)
    wrong = torch.randint(6, 11, (rewards.numel(),), generator=g)
    resp = torch.where(rewards > 0, right, wrong)  # wrong answers longer: sign-correlated
    prompt = torch.randint(2, 5, (rewards.numel(),), generator=g)
    s = 16  # >= max prompt + response (4 + 10), a multiple of 2 x CP for CP in {1, 2, 4}
    tokens = torch.randint(1, spec.vocab_size, (rewards.numel(), s), generator=g)
    pos = torch.arange(s)[None]
    mask = (pos >= prompt[:, None]) & (pos < (prompt + resp)[:, None])
    tokens = torch.where(pos < (prompt + resp)[:, None], tokens, torch.zeros_like(tokens))
    from megatron_ba.advantages import group_advantages

    adv = group_advantages(rewards, group_ids).advantages.float()
    return {"tokens": tokens, "response_mask": mask, "advantages": adv, "group_ids": group_ids}


def dp_rows(n: int, dp: int, rank: int) -> torch.Tensor:
    """Rows of DP rank `rank`: every dp-th row, so that each group of 3 spans the DP ranks."""
    return torch.arange(rank, n, dp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, layout: Layout) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_ba.megatron import cpu_compat

    cpu_compat.install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(layout.tp, layout.pp, context_parallel_size=layout.cp)
    cpu_compat.seed_model_parallel_rng(0)


def _build(per_token_loss: bool, seed: int):
    from megatron_ba.megatron import model as mm

    spec = _spec()
    config = mm.transformer_config(spec, calculate_per_token_loss=per_token_loss)
    chunks = mm.build_model_chunks(
        spec, config=config, pg_collection=mm.model_pg_collection_without_cp()
    )
    mm.load_full_state_dict(chunks, mm.full_init_state_dict(spec, seed))
    return chunks


def _run_case(chunks, batch: dict, rows: torch.Tensor, case: Case):
    from megatron.core import parallel_state

    from megatron_ba.megatron.grpo_step import GRPOBatch, StepConfig, forward_backward
    from megatron_ba.megatron.model import gather_full_state_dict
    from megatron_ba.parallel.collectives import StatisticsReducer

    local = GRPOBatch(
        tokens=batch["tokens"][rows],
        response_mask=batch["response_mask"][rows],
        advantages=batch["advantages"][rows],
        group_ids=batch["group_ids"][rows],
        old_logprobs=batch["old_logprobs"][rows],
        ref_logprobs=batch["ref_logprobs"][rows],
    )
    cfg = StepConfig(
        num_groups=NUM_GROUPS,
        num_microbatches=case.num_microbatches,
        rule=case.rule,
        scope=case.scope,
        max_length=16,
        loss=LOSS_CONFIG,
        normalization=case.normalization,
        assume_megatron_version=(
            tuple(case.assume_megatron_version) if case.assume_megatron_version else None
        ),
    )
    reducer = StatisticsReducer(parallel_state.get_data_parallel_group())
    result = forward_backward(chunks, local, cfg, reducer=reducer)
    return result, reducer.calls, gather_full_state_dict(chunks, grads=True)


def _reference_worker(rank: int, port: int, seed: int, keys: list, out_path: str) -> None:
    _init(rank, 1, port, Layout())
    from megatron_ba.megatron.grpo_step import compute_logprobs

    chunks = _build(False, seed)
    batch = synthetic_batch(seed)
    logp, _ = compute_logprobs(chunks, batch["tokens"])
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    batch["ref_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    out = {"batch": batch, "results": {}}
    rows = torch.arange(batch["tokens"].shape[0])
    for rule, scope in keys:
        result, _, grads = _run_case(chunks, batch, rows, Case(rule, 1, scope))
        out["results"][(rule, scope)] = (result.loss, grads)
    torch.save(out, out_path)
    torch.distributed.destroy_process_group()


def _layout_worker(rank, world, port, layout, cases, ref_path, out_path) -> None:
    _init(rank, world, port, layout)
    from megatron.core import parallel_state

    ref = torch.load(ref_path, weights_only=False)
    batch = ref["batch"]
    rows = dp_rows(batch["tokens"].shape[0], layout.dp, parallel_state.get_data_parallel_rank())
    models = {}
    report = []
    for case in cases:
        if case.per_token_loss not in models:
            models[case.per_token_loss] = _build(case.per_token_loss, ref["seed"])
        result, calls, grads = _run_case(models[case.per_token_loss], batch, rows, case)
        all_calls = [None] * world
        torch.distributed.all_gather_object(all_calls, calls)
        loss_ref, grads_ref = ref["results"][(case.rule, case.scope)]
        rel = max(
            float((grads[k] - grads_ref[k]).abs().max() / grads_ref[k].abs().max().clamp(min=1e-30))
            for k in grads_ref
        )
        if set(grads) != set(grads_ref):
            rel = float("inf")
        report.append(
            dict(
                case=asdict(case),
                max_rel_grad_err=rel,
                loss_err=abs(result.loss - loss_ref),
                loss=result.loss,
                loss_ref=loss_ref,
                reducer_calls=all_calls,
            )
        )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    torch.distributed.destroy_process_group()


def _spawn(fn, nprocs: int, args: tuple) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")


def compute_reference(cases: list[Case], seed: int, path: str) -> None:
    """The single-process results of every (rule, scope) in `cases`, saved to `path`."""
    keys = sorted({(c.rule, c.scope) for c in cases})
    _spawn(_reference_worker, 1, (_free_port(), seed, keys, path))
    ref = torch.load(path, weights_only=False)
    ref["seed"] = seed
    torch.save(ref, path)


def run_layout(
    layout: Layout, cases: list[Case], *, seed: int = 0, reference: str | None = None
) -> list[CaseResult]:
    """Run every case on `layout` in one launch and compare with the single-process reference.

    `reference`: a file written by `compute_reference` for these cases and seed (computed here,
    in a temporary file, when None).
    """
    check_layout_possible(layout, cases)
    with tempfile.TemporaryDirectory() as tmp:
        if reference is None:
            reference = os.path.join(tmp, "reference.pt")
            compute_reference(cases, seed, reference)
        out = os.path.join(tmp, "report.json")
        _spawn(
            _layout_worker,
            layout.world,
            (layout.world, _free_port(), layout, cases, reference, out),
        )
        with open(out) as f:
            report = json.load(f)
    return [
        CaseResult(
            case=Case(**r["case"]),
            max_rel_grad_err=r["max_rel_grad_err"],
            loss_err=r["loss_err"],
            loss=r["loss"],
            loss_ref=r["loss_ref"],
            reducer_calls=r["reducer_calls"],
        )
        for r in report
    ]
