"""What the Slurm launchers ask of a recipe, answered by the project's own recipe loader.

    python -m megatron_ba.planning.launch fit RECIPE --nodes 4 --gpus-per-node 8 [key=value ...]
    python -m megatron_ba.planning.launch fit RECIPE --hostlist 'gpu[01-04]' --gpus-per-node 8
    python -m megatron_ba.planning.launch hosts 'gpu[01-04],cpu7'

`fit` loads the recipe with its overrides (strictly, as `megatron-ba train` does), checks that
nodes x GPUs per node holds the recipe's TP x PP x CP a whole number of times (DP is what is
left), and prints shell assignments (NAME=..., TP=..., DP=..., RUN_NAME=...) for slurm/lib.sh to
`eval`. When it does not fit it exits 3 with a message saying what to change; a recipe, override
or host list it cannot read exits 2 (slurm/lib.sh tells the two apart). `--gpus-per-node 0`
means "not given and no GPU here": the CPU default, one gloo process per model-parallel rank.
`--write-recipe PATH` saves the resolved recipe. `hosts` expands a Slurm host list (the fallback
when `scontrol show hostnames` cannot run, e.g. a DRY_RUN away from any cluster).

On GPUs it also asks the memory planner (planning/verdict.py, the verdict `megatron-ba layout`
reports as "fits") whether the recipe's layout fits each GPU: the recipe's whole
ParallelLayout (expert parallelism included) and its step's settings (`recipe_plan`), for the model
it trains (a checkpoint's config.json it can read, or a fresh model's shape keys; a checkpoint
path it cannot read here is not checked, and says so). GPU memory from `--gpu-mem GIB`, else the
environment's MBA_GPU_MEM_GIB, else `nvidia-smi` on this node (none of them: the check is skipped,
and says so). A layout that fits prints RECIPE_MEMORY_GIB (the estimate per GPU); one that does
not exits 3 naming the single changes that would make it fit (e.g.
"parallel.recompute=full (61.2 GiB)" or "parallel.cp=2"). `--headroom F` is the verdict's headroom
(the fraction of the GPU the tensors' peak leaves free; default planning.verdict.HEADROOM), the
same rule `megatron-ba layout --headroom` applies.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_ba.model_shape import ModelShape
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS, LayoutError, ParallelLayout
from megatron_ba.planning.architectures import Unmodelled
from megatron_ba.planning.memory import EngineShare, MemorySettings, load_model, padded_seq_len
from megatron_ba.planning.verdict import HEADROOM, Verdict, assess, check_headroom, remedies
from megatron_ba.recipe import RecipeError, load_recipe


class FitError(ValueError):
    """The allocation cannot hold the recipe's layout; the message says what to change."""


FIT_EXIT = 3  # `fit`'s exit status when the allocation cannot hold the layout (2: bad input)


def check_fit(layout: ParallelLayout, nodes: int, gpus_per_node: int) -> ParallelLayout:
    """The recipe's `layout` on `nodes` x `gpus_per_node` ranks (its dp what they leave)."""
    if nodes < 1:
        raise FitError(f"nodes: must be >= 1, got {nodes}")
    if gpus_per_node < 1:
        raise FitError(f"GPUS_PER_NODE: must be >= 1, got {gpus_per_node}")
    tp = layout.tp
    if tp > gpus_per_node:
        raise FitError(
            f"parallel.tp={tp} is larger than GPUS_PER_NODE={gpus_per_node}: tensor parallelism "
            f"must stay inside a node (NVLink); use parallel.tp<={gpus_per_node} and more "
            f"parallel.pp instead"
        )
    if gpus_per_node % tp:
        raise FitError(
            f"parallel.tp={tp} does not divide GPUS_PER_NODE={gpus_per_node}: a TP group would "
            f"straddle two nodes; use a parallel.tp that divides {gpus_per_node}"
        )
    world = nodes * gpus_per_node
    try:
        return layout.for_world(world)
    except LayoutError as e:
        mp = layout.model_parallel
        if e.key != "world":  # the world leaves a dp the layout's experts cannot be carved from
            raise FitError(
                f"{e.renamed(RECIPE_KEYS)} (on {nodes} x {gpus_per_node} GPUs)"
            ) from None
        need_nodes = mp // math.gcd(mp, gpus_per_node)  # smallest node count that fits
        raise FitError(
            f"{nodes} node(s) x {gpus_per_node} GPU(s) = {world} ranks is not a multiple of "
            f"parallel.tp x pp x cp = {layout.tp} x {layout.pp} x {layout.cp} = {mp}: submit "
            f"with --nodes a multiple of {need_nodes}, or change parallel.tp/pp/cp so that their "
            f"product divides {world}"
        ) from None


_RANGE = re.compile(r"\[([^\]]+)\]")


def expand_hostlist(text: str) -> list[str]:
    """`gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1 (Slurm's grammar, zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        parts = [item]
        while any(_RANGE.search(p) for p in parts):
            expanded = []
            for p in parts:
                m = _RANGE.search(p)
                if m is None:
                    expanded.append(p)
                    continue
                head, tail = p[: m.start()], p[m.end() :]
                for piece in m.group(1).split(","):
                    lo, _, hi = piece.partition("-")
                    if not lo.isdigit() or (hi and not hi.isdigit()):
                        raise ValueError(f"SLURM_JOB_NODELIST: bad range {piece!r} in {text!r}")
                    width = len(lo)
                    for i in range(int(lo), int(hi or lo) + 1):
                        expanded.append(f"{head}{i:0{width}d}{tail}")
            parts = expanded
        hosts += parts
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST: no host in {text!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [x for x in out if x]


def gpu_memory_here(given: float | None) -> float | None:
    """GiB per GPU: `given`, else MBA_GPU_MEM_GIB, else nvidia-smi's first GPU, else None."""
    if given is not None:
        return given
    if os.environ.get("MBA_GPU_MEM_GIB"):
        return float(os.environ["MBA_GPU_MEM_GIB"])
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return float(first[0]) / 1024 if out.returncode == 0 and first else None  # MiB -> GiB


def recipe_shape(recipe) -> ModelShape | None:
    """The model a recipe trains, as the planner reads it: the checkpoint's config.json
    (model.pretrained), or a fresh model's shape keys with the tokenizer's vocabulary; None when
    the checkpoint's config.json is not readable here."""
    if recipe.model.pretrained:
        config = Path(recipe.model.pretrained, "config.json")
        return load_model(str(config)) if config.is_file() else None
    return recipe.model.fresh_shape(recipe.tokenizer.vocab_size)


def recipe_plan(recipe, dp: int) -> tuple[ParallelLayout, MemorySettings, EngineShare | None, int]:
    """The planner's inputs for a recipe on `dp` data-parallel ranks: its ParallelLayout, its
    step's settings (micro-batch tokens, recomputation, the log-prob chunk, a reference policy
    with the KL term, one optimiser step's tokens: grpo.prompts_per_step x group_size /
    mini_batches sequences; the gradients in fp32, as this project's trainer reduces them),
    its colocated vLLM engine (its share, sleep, TP, process and refit bucket) and its padded
    sequence length (as `megatron-ba layout` counts one)."""
    p, g = recipe.parallel, recipe.grpo
    seq_len = padded_seq_len((recipe.data.max_prompt_tokens or 512) + g.max_new_tokens)
    sequences = g.prompts_per_step * g.group_size // max(1, g.mini_batches)
    step = MemorySettings(
        p.max_tokens_per_microbatch or p.micro_batch_size * seq_len,
        recompute=p.recompute,
        logprob_chunk=p.logprob_chunk_size or MemorySettings.logprob_chunk,
        reference=recipe.loss.kl_coef > 0,
        step_tokens=sequences * seq_len,
    )
    r = recipe.rollout
    vllm = None
    if r.engine == "vllm":
        vllm = EngineShare(r.gpu_memory_utilization, sleeps=r.sleep, tp=r.engine_tp,
                           in_process=r.in_process, refit_bucket_mb=r.refit_bucket_mb)  # fmt: skip
    return p.layout(dp), step, vllm, seq_len


def check_memory(
    recipe, layout: ParallelLayout, gpus_per_node: int, gpu_mem_gib: float,
    headroom: float = HEADROOM,
):  # fmt: skip
    """(the verdict, None) when the recipe on `layout` fits GPUs of `gpu_mem_gib`, else (the
    verdict, what to change: FitError text); (None, None) when the model cannot be read here.
    `headroom`: the verdict's (planning.verdict.assess), as `megatron-ba layout --headroom`."""
    shape = recipe_shape(recipe)
    if shape is None:
        return None, None
    layout, step, vllm, seq_len = recipe_plan(recipe, layout.dp)
    try:  # the model's rules (Gated DeltaNet layers: cp 1), under the recipe's keys
        layout.check_training(shape)
    except LayoutError as e:
        raise ValueError(e.renamed(RECIPE_KEYS)) from None
    v = assess(shape, layout, step, gpu_mem_gib=gpu_mem_gib, vllm=vllm, seq_len=seq_len,
               headroom=headroom)  # fmt: skip
    if v.fits:
        return v, None
    fixes = remedies(
        shape,
        layout,
        step,
        gpu_mem_gib=gpu_mem_gib,
        vllm=vllm,
        seq_len=seq_len,
        gpus_per_node=gpus_per_node,
        headroom=headroom,
    )
    say = ", or ".join(f"{key} ({gib} GiB)" for _, key, gib in fixes)
    hint = f"it fits with {say}" if fixes else "no single change of the layout or vLLM's TP fits"
    return v, (
        f"the layout ({layout}) does not fit GPUs of {gpu_mem_gib:.1f} GiB: {v.reason}; {hint} "
        f"(megatron-ba layout --help: the estimate)"
    )


def _memory_verdict(args, recipe, layout, gpus) -> tuple[int, Verdict | None]:
    """(exit status so far, the memory verdict) of the fit's memory check (module docstring)."""
    gpu_mem = gpu_memory_here(args.gpu_mem) if args.gpus_per_node else None
    if not args.gpus_per_node:
        return 0, None
    if gpu_mem is None:
        print("launch: GPU memory unknown (no --gpu-mem, MBA_GPU_MEM_GIB or nvidia-smi): the "
              "memory check is skipped", file=sys.stderr)  # fmt: skip
        return 0, None
    try:
        verdict, problem = check_memory(recipe, layout, gpus, gpu_mem, args.headroom)
    except Unmodelled as e:
        print(f"launch: the memory check is skipped: {e}", file=sys.stderr)
        return 0, None
    except ValueError as e:
        print(f"launch: {args.recipe}: {e}", file=sys.stderr)
        return 2, None
    if verdict is None:
        print(f"launch: {recipe.model.pretrained}/config.json is not readable here: the memory "
              "check is skipped", file=sys.stderr)  # fmt: skip
    if problem:
        print(f"launch: {args.recipe}: {problem}", file=sys.stderr)
        return FIT_EXIT, verdict
    return 0, verdict


def _fit(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    hosts = []
    if args.hostlist is not None:
        try:
            hosts = expand_hostlist(args.hostlist)
        except ValueError as e:
            print(f"launch: {e}", file=sys.stderr)
            return 2
    nodes = args.nodes if args.nodes is not None else len(hosts)
    layout = recipe.parallel.layout()
    gpus = args.gpus_per_node or layout.model_parallel  # CPU: the processes the recipe needs
    try:
        layout = check_fit(layout, nodes, gpus)
    except FitError as e:
        print(f"launch: {args.recipe}: {e}", file=sys.stderr)
        return FIT_EXIT
    status, verdict = _memory_verdict(args, recipe, layout, gpus)
    if status:
        return status
    if args.write_recipe:
        Path(args.write_recipe).parent.mkdir(parents=True, exist_ok=True)
        recipe.dump(args.write_recipe)
    values = {
        "NAME": recipe.name,
        "RULE": recipe.loss.rule,
        "BACKEND": recipe.backend,
        "STEPS": recipe.grpo.steps,
        "TP": layout.tp,
        "PP": layout.pp,
        "CP": layout.cp,
        "DP": layout.dp,
        "EP": layout.ep,
        "WORLD": layout.world,
        "GPUS_PER_NODE": gpus,
        "RUN_NAME": f"{recipe.name}-{recipe.loss.rule}",  # megatron-ba train's default folder
        "NODES": nodes,
    }
    if hosts:
        values["HOSTS"] = " ".join(hosts)
    if verdict is not None:
        values["MEMORY_GIB"] = f"{verdict.estimate.total_gib:.2f}"
    for k, v in values.items():
        print(f"RECIPE_{k}={shlex.quote(str(v))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hosts"] and len(argv) == 2:
        try:
            print("\n".join(expand_hostlist(argv[1])))
        except ValueError as e:
            print(f"launch: {e}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] != ["fit"]:
        print(__doc__, file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m megatron_ba.planning.launch fit")
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="key.path=value, as for megatron-ba train")
    ap.add_argument("--nodes", type=int, help="default: the hosts of --hostlist")
    ap.add_argument("--hostlist", help="a Slurm host list, expanded into RECIPE_HOSTS")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="0: CPU, tp*pp*cp processes")
    ap.add_argument("--write-recipe", help="save the resolved recipe here")
    ap.add_argument("--gpu-mem", type=float, metavar="GIB", help="GiB per GPU (memory check)")
    ap.add_argument(
        "--headroom",
        type=float,
        default=HEADROOM,
        help="fraction of the GPU the tensors' peak must leave free, part of the memory check's "
        f"verdict, as for megatron-ba layout (default {HEADROOM})",
    )
    args = ap.parse_intermixed_args(argv[1:])
    if args.nodes is None and args.hostlist is None:
        ap.error("give --nodes or --hostlist")
    try:
        check_headroom(args.headroom)
    except ValueError as e:
        ap.error(str(e))
    return _fit(args)


if __name__ == "__main__":
    sys.exit(main())
