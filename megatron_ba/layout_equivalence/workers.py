"""The process bodies of the layout equivalence check (its check.py spawns them).

`reference_worker` (one process, TP=PP=CP=DP=1, one micro-batch) computes the model's log-probs
and entropy (checked against a direct forward + log_softmax), the noisy old/reference log-probs
of the synthetic batch, every (rule, scope)'s loss and full gradients, and one clipped AdamW step.
`layout_worker` (tp*pp*cp*dp processes) recomputes all of that on its layout and writes the
errors (rank 0) to a JSON file. Both are started by check.py (parallel.world.spawn).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict

import torch

from megatron_ba.layout_equivalence.cases import (
    DECAY_PARAMETERS,
    Case,
    case_rows,
    num_groups,
    synthetic_batch,
    tiny_spec,
)
from megatron_ba.megatron import model as mm
from megatron_ba.megatron.batching import GRPOBatch, causal_mask, response_end
from megatron_ba.megatron.build_options import expert_config_fields, resolve_build_options
from megatron_ba.megatron.cpu_optimizer import ShardedAdamW
from megatron_ba.megatron.grpo_step import MicroBatchSpec, compute_logprobs
from megatron_ba.megatron.mcore_compat import cp_shard_batch
from megatron_ba.megatron.startup import setup
from megatron_ba.parallel import collectives, full_shape
from megatron_ba.parallel.collectives import StatisticsReducer
from megatron_ba.parallel.full_shape import gather_full_state_dict
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.parallel.sharding import cp_shard
from megatron_ba.rollout_correction import correct_rows, correction_diagnostics

# One clipped AdamW step (eps 1e-2 keeps the update a smooth function of the gradient, so that
# float32 rounding in the gradient stays small in the update; the clip threshold is below the
# gradient norm, so clipping is exercised).
OPTIMIZER = dict(lr=1e-3, eps=1e-2, clip_grad=0.5)
OPTIMIZER_CASE = Case("balanced", 1)


def _init(rank: int, world: int, port: int, layout: ParallelLayout) -> None:
    # megatron-core warns at import that Apex / Transformer Engine are missing: expected on CPU.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    torch.set_num_threads(1)
    setup(layout, seed=0, backend="gloo", rank=rank, world_size=world, port=port)


def _build(
    per_token_loss: bool,
    seed: int,
    layout: ParallelLayout,
    model: str = "debug",
    attention: str = "unfused",
):
    spec = tiny_spec(model)
    # the config's EP decides which expert parameters DDP reduces where
    experts = expert_config_fields(spec, layout)
    # The world's device (gloo: the CPU): the layout check runs where its collectives do.
    device = collectives.comm_device(None)
    options = resolve_build_options(device=device, attention=attention, layout=layout)
    config = mm.transformer_config(
        spec,
        calculate_per_token_loss=per_token_loss,
        sequence_parallel=options.sequence_parallel,
        **dict(options.stage_fields),
        **experts,
    )
    chunks = mm.build_model_chunks(
        spec,
        config=config,
        layer_spec=options.layer_spec(spec, config),
        pg_collection=mm.model_pg_collection_without_cp(),
    )
    _check_stage_layers(chunks, layout, spec.num_layers)
    full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, seed))
    return chunks


def _check_stage_layers(chunks, layout: ParallelLayout, num_layers: int) -> None:
    """RuntimeError unless this stage built the layers the layout gives it (global numbers
    from its offset): an uneven split megatron-core did not apply would still run, the layers
    of the full-shape comparison silently shifted."""
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    offset = layout.layer_offset(num_layers, stage)
    want = list(range(offset + 1, offset + 1 + layout.stage_layers(num_layers)[stage]))
    built = [layer.layer_number for layer in full_shape.unwrap(chunks[0]).decoder.layers]
    if built != want:
        raise RuntimeError(f"{layout}: stage {stage} built layers {built}, the layout gives {want}")


def _local_batch(batch: dict, rows: torch.Tensor, case: Case):
    """This DP rank's batch, its rollout correction computed on its own rows (whole sequences),
    before the plan, by the trainer's own correct_rows (train/update.py)."""
    mask, old, weights = batch["response_mask"][rows], batch["old_logprobs"][rows], None
    if "rollout_logprobs" in batch:  # the reference's batch has them (so the correction acts)
        settings = case.step_settings().rollout_correction
        kept, weights, _ = correct_rows(settings, old, batch["rollout_logprobs"][rows], mask)
        if not case.rejected_kept_in_denominators:
            mask = kept
    return GRPOBatch(
        tokens=batch["tokens"][rows],
        response_mask=mask,
        advantages=batch["advantages"][rows],
        group_ids=batch["group_ids"][rows],
        old_logprobs=old,
        ref_logprobs=batch["ref_logprobs"][rows],
        is_weights=weights,
    )


def _run_case(chunks, batch: dict, rows: torch.Tensor, case: Case):
    from megatron.core import parallel_state

    split = MicroBatchSpec(case.num_microbatches, max_tokens_per_microbatch=case.token_budget)
    reducer = StatisticsReducer(parallel_state.get_data_parallel_group())
    step = case.step_function()
    groups = num_groups(batch["tokens"].shape[0])  # of the whole synthetic batch
    local = _local_batch(batch, rows, case)
    result = step(chunks, local, case.step_settings(), split, num_groups=groups, reducer=reducer)
    return result, reducer.calls, gather_full_state_dict(chunks, grads=True)


def _fraction_corrected(batch: dict, case: Case) -> float:
    """The share of the whole batch's response tokens the case's correction acts on."""
    old, rollout, mask = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    _, _, stats = correct_rows(case.step_settings().rollout_correction, old, rollout, mask)
    return correction_diagnostics(stats)["rollout_correction/fraction_corrected"]


def _optimizer_step(chunks, batch: dict, rows: torch.Tensor):
    """(gradient norm, full-shape parameter change) of one clipped AdamW step."""

    before = gather_full_state_dict(chunks)
    _run_case(chunks, batch, rows, OPTIMIZER_CASE)
    applied, norm = ShardedAdamW(chunks, **OPTIMIZER).step()
    assert applied
    after = gather_full_state_dict(chunks)
    return norm, {k: after[k] - before[k] for k in after}


def _direct_logprobs(chunks, tokens: torch.Tensor):
    """Log-probs and entropy from one plain forward of the (single-process) model."""
    n, s = tokens.shape
    pos = torch.arange(s).expand(n, s)
    with torch.no_grad():
        logp_all = torch.log_softmax(chunks[0](tokens, pos, causal_mask(s)).double(), dim=-1)
    lp = torch.zeros(n, s, dtype=torch.float64)
    lp[:, 1:] = logp_all[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ent = torch.zeros(n, s, dtype=torch.float64)
    ent[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    return lp, ent


def reference_worker(
    rank: int, port: int, seed: int, keys: list, out_path: str, sequences: int, model: str
) -> None:
    one = ParallelLayout()
    _init(rank, 1, port, one)

    chunks = _build(False, seed, one, model)
    batch = synthetic_batch(seed, sequences, model)
    logp, ent = compute_logprobs(chunks, batch["tokens"], with_entropy=True)
    lp_direct, ent_direct = _direct_logprobs(chunks, batch["tokens"])
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    batch["ref_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    # The rollout engine's log-probs: the old ones plus noise, so that the correction acts.
    batch["rollout_logprobs"] = batch["old_logprobs"] + 0.4 * torch.randn(logp.shape, generator=g)
    rows = torch.arange(batch["tokens"].shape[0])
    out = {
        "seed": seed,
        "batch": batch,
        "logprobs": logp,
        "entropy": ent,
        "direct_logprobs_err": float((logp.double() - lp_direct).abs().max()),
        "direct_entropy_err": float((ent.double() - ent_direct).abs().max()),
        "results": {},
    }
    for rule, scope, mode in keys:
        case = Case(rule, 1, scope, rollout_correction=mode)
        result, _, grads = _run_case(chunks, batch, rows, case)
        out["results"][(rule, scope, mode)] = (result.loss, grads)
    out["optimizer"] = _optimizer_step(chunks, batch, rows)
    torch.save(out, out_path)
    collectives.destroy_process_group()


def _rel_err(g: torch.Tensor, ref: torch.Tensor) -> float:
    """max |g - ref| / max |ref| (a tensor whose reference is all 0 must be all 0)."""
    scale = float(ref.abs().max())
    diff = float((g.double() - ref.double()).abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _max_rel_err(tensors: dict, refs: dict, *, decay: bool = False) -> float:
    """The largest _rel_err over the parameters other than the Gated DeltaNet decay ones, or with
    decay=True over those (0.0 if the model has none); inf if the names differ."""
    if set(tensors) != set(refs):  # a missing or extra parameter fails the check
        return float("inf")
    errs = [_rel_err(tensors[k], refs[k]) for k in refs if k.endswith(DECAY_PARAMETERS) == decay]
    return max(errs, default=0.0)


def _cp_layout_matches_megatron(tokens: torch.Tensor) -> bool:
    """Our CP shard of the tokens is megatron-core's get_batch_on_this_cp_rank (real CP group)."""
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    rank = parallel_state.get_context_parallel_rank()
    group = parallel_state.get_context_parallel_group()
    theirs = cp_shard_batch({"tokens": tokens.clone()}, group)["tokens"]
    return bool(torch.equal(theirs, cp_shard(tokens, cp=cp, rank=rank, dim=1)))


def layout_worker(rank, world, port, layout, model, attention, cases, ref_path, out_path) -> None:
    _init(rank, world, port, layout)
    from megatron.core import parallel_state

    ref = torch.load(ref_path, weights_only=False)
    batch = ref["batch"]
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_ok = all(collectives.all_gather_object(_cp_layout_matches_megatron(batch["tokens"])))
    models = {False: _build(False, ref["seed"], layout, model, attention)}
    # Forward-only log-probs on the first case's rows and micro-batches (token budget: each row
    # run on its prompt + response only; the positions past it are 0 and not compared).
    first = cases[0]
    rows = case_rows(batch, layout, first, dp_rank)
    seq_tokens = response_end(batch["response_mask"][rows]) if first.token_budget else None
    logp, ent = compute_logprobs(
        models[False],
        batch["tokens"][rows],
        MicroBatchSpec(
            min(max(c.num_microbatches for c in cases), len(rows)),
            max_tokens_per_microbatch=first.token_budget,
        ),
        with_entropy=True,
        seq_tokens=seq_tokens,
    )
    s = batch["tokens"].shape[1]
    seen = torch.arange(s)[None] < torch.tensor(seq_tokens or [s] * len(rows))[:, None]
    errs = [(x - ref[k][rows]).abs()[seen].max() for x, k in ((logp, "logprobs"), (ent, "entropy"))]
    lp_err, ent_err = (max(collectives.all_gather_object(float(e))) for e in errs)
    report = []
    for case in cases:
        if case.per_token_loss not in models:
            models[case.per_token_loss] = _build(
                case.per_token_loss, ref["seed"], layout, model, attention
            )
        rows = case_rows(batch, layout, case, dp_rank)
        result, calls, grads = _run_case(models[case.per_token_loss], batch, rows, case)
        loss_ref, grads_ref = ref["results"][(case.rule, case.scope, case.rollout_correction)]
        report.append(
            dict(
                case=asdict(case),
                max_rel_grad_err=_max_rel_err(grads, grads_ref),
                loss_err=abs(result.loss - loss_ref),
                loss=result.loss,
                loss_ref=loss_ref,
                reducer_calls=collectives.all_gather_object(calls),
                fraction_corrected=_fraction_corrected(batch, case),
                max_rel_decay_grad_err=_max_rel_err(grads, grads_ref, decay=True),
            )
        )
    rows = case_rows(batch, layout, OPTIMIZER_CASE, dp_rank)
    norm, delta = _optimizer_step(models[False], batch, rows)
    norm_ref, delta_ref = ref["optimizer"]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                dict(
                    cases=report,
                    cp_layout_matches_megatron=cp_ok,
                    logprobs_err=lp_err,
                    entropy_err=ent_err,
                    grad_norm_rel_err=abs(norm - norm_ref) / norm_ref,
                    update_rel_err=_max_rel_err(delta, delta_ref),
                ),
                f,
            )
    collectives.destroy_process_group()
