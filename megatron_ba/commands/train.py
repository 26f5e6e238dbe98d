"""`megatron-ba train RECIPE [key=value ...]`: a GRPO run with the recipe's backend.

    megatron-ba train recipes/tiny-cpu.yaml                       # the CPU main job (~2.5 min)
    megatron-ba train recipes/tiny-cpu.yaml loss.rule=token grpo.steps=20 --run-dir runs/tok
    megatron-ba train recipes/tiny-cpu.yaml --resume runs/tiny-cpu-balanced
    kill -USR1 PID    # or touch RUN_DIR/PREEMPT: checkpoint at the next step, exit 75
    megatron-ba train --nproc-per-node 2 recipes/tiny-cpu-tp2.yaml   # TP=2: two processes
    megatron-ba train recipes/qwen3-1.7b-dapo17k.yaml backend=verl data.path=F.parquet \
        eval.data_dir=DIR --print-overrides    # verl's ppo_megatron_trainer overrides
    megatron-ba train recipes/qwen3-1.7b-dapo17k.yaml backend=nemo_rl grpo.mini_batches=1 \
        eval.samples=1 eval.benchmarks=aime24,aime25 eval.data_dir=DIR --print-overrides

The run folder (default runs/<recipe name>-<rule>) receives recipe.yaml (resolved), metrics.jsonl,
summary.json, plots/*.png, checkpoints/ (sharded; `megatron-ba convert STEP_DIR OUT --to hf`
makes a Hugging Face folder of one) and hf/ (the last step's policy, for `megatron-ba eval`).
The terminal shows the progress bar, evaluation lines and the summary; what vLLM, megatron-core
and the other libraries print goes to logs/rank-<r>.log in the run folder (`--verbose`: all of it
on the terminal).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from megatron_ba.data.templates import render_prompt
from megatron_ba.errors import UserError
from megatron_ba.integrations.engines.run_engine import LaunchOptions, RunFiles, launch
from megatron_ba.parallel.local_launch import add_nproc_argument
from megatron_ba.recipe import RecipeError, load_recipe
from megatron_ba.train import warmstart_cache
from megatron_ba.train.console import Console
from megatron_ba.train.prompt_files import prompt_file_paths, write_prompt_files


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (recipes/*.yaml); its schema: docs/recipes.md")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides (YAML values)")
    p.add_argument("--run-dir", help="run folder (default runs/<name>-<rule>)")
    p.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint"
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=warmstart_cache(),
        help="warm-start cache, shared by every clone (default $XDG_CACHE_HOME/megatron-ba, "
        "~/.cache/megatron-ba)",
    )
    p.add_argument(
        "--print-overrides",
        action="store_true",
        help="backend=nemo_aligner, verl or nemo_rl: print the recipe's overrides, launch nothing",
    )
    p.add_argument(
        "--print-command",
        action="store_true",
        help="backend=verl or nemo_rl: print the entry command the run becomes (one line, shell "
        "words), launch nothing; a recipe the backend cannot honour is refused (exit 2)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="backend=nemo_aligner: trainer.num_nodes; verl: trainer.nnodes; nemo_rl: "
        "cluster.num_nodes",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="nemo_aligner: trainer.devices (default TP x PP); verl: trainer.n_gpus_per_node, "
        "nemo_rl: cluster.gpus_per_node (default 8)",
    )
    p.add_argument(
        "--accelerator",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="nemo_aligner: trainer.accelerator (auto: gpu where torch sees one, else cpu)",
    )
    add_nproc_argument(p)
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every library's output on the terminal (default: RUN_DIR/logs/rank-<r>.log)",
    )


def _launch_engine(recipe, args: argparse.Namespace, run_dir: Path) -> int:
    """backend=verl, nemo_rl or nemo_aligner: the engine's launch (integrations/engines/
    launch.py), with the local backend's prompt writers for the files it puts in RUN_DIR."""
    options = LaunchOptions(
        print_overrides=args.print_overrides,
        print_command=args.print_command,
        nodes=args.nodes,
        devices=args.devices,
        accelerator=args.accelerator,
    )
    files = RunFiles(prompt_file_paths, write_prompt_files, render_prompt)
    return launch(recipe, run_dir, options, files)


def _remove_refused_run(run_dir: Path, rank: int, log_path: Path) -> None:
    """A new run refused at start-up leaves no folder: rank 0 removes it; another rank (whose
    console may have made its log after rank 0 removed the folder) removes its own log and the
    folders that this leaves empty."""
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    log_path.unlink(missing_ok=True)
    for folder in (log_path.parent, run_dir):
        try:
            folder.rmdir()
        except OSError:  # gone already, or holds another rank's log: that rank removes it
            pass


def run(args: argparse.Namespace) -> int:
    try:
        if args.resume:
            run_dir = Path(args.resume)
            saved = run_dir / "recipe.yaml"
            if not saved.is_file():
                raise UserError(f"train: --resume {run_dir}: no recipe.yaml there")
            recipe = load_recipe(saved, args.overrides)
        else:
            recipe = load_recipe(args.recipe, args.overrides)
            run_dir = Path(args.run_dir or f"runs/{recipe.name}-{recipe.loss.rule}")
    except RecipeError as e:
        raise UserError(f"train: {e}") from None
    if args.print_command and recipe.backend not in ("verl", "nemo_rl"):
        raise UserError(
            f"train: --print-command is for backend=verl or nemo_rl, not {recipe.backend}"
        )
    if recipe.backend in ("nemo_aligner", "verl", "nemo_rl"):
        return _launch_engine(recipe, args, run_dir)
    if args.print_overrides:
        raise UserError("train: --print-overrides is for backend=nemo_aligner, verl or nemo_rl")
    # torch: imported on use, so that --help imports none
    from megatron_ba.train import preemption

    rank = int(os.environ.get("RANK", "0"))
    # Another rank's console may already have made RUN_DIR/logs: a folder with nothing else is new.
    fresh = not args.resume and (
        not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {"logs"}
    )
    console = Console(run_dir / "logs", rank=rank, verbose=args.verbose)
    preemption.install()  # SIGUSR1: checkpoint at the next step boundary and stop
    with console:  # before the heavy imports: their warnings go to the log file too
        # torch: imported on use, so that --help imports none
        from megatron_ba.train.driver import Trainer

        log = console.log if rank == 0 else (lambda _msg: None)
        try:
            trainer = Trainer(
                recipe, run_dir, resume=bool(args.resume), cache_dir=Path(args.cache_dir), log=log
            )
        except UserError:  # bad input (a data file, a checkpoint): no run folder is left behind
            if fresh:
                console.close(say_where=False)
                _remove_refused_run(run_dir, rank, console.log_path)
            raise
        try:
            summary = trainer.run(progress_stream=console.stream)
        except preemption.Preempted as e:
            console.log(f"train: {e}; continue with --resume {run_dir}")
            return preemption.PREEMPTED_EXIT_CODE
        finally:
            trainer.close()
    if summary:
        print(json.dumps(summary, indent=2))
        print(f"run folder: {run_dir}")
    return 0
