"""`megatron-ba train RECIPE [key=value ...]`: a GRPO run with the recipe's backend.

    megatron-ba train recipes/tiny-cpu.yaml                       # the CPU main job (~2.5 min)
    megatron-ba train recipes/tiny-cpu.yaml loss.rule=token grpo.steps=20 --run-dir runs/tok
    megatron-ba train recipes/tiny-cpu.yaml --resume runs/tiny-cpu-balanced
    kill -USR1 PID    # or touch RUN_DIR/PREEMPT: checkpoint at the next step, exit 75
    torchrun --nproc-per-node 2 -m megatron_ba.cli train recipes/tiny-cpu-tp2.yaml
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
import sys
from pathlib import Path

from megatron_ba.data.templates import render_prompt
from megatron_ba.integrations import nemo_rl_recipe
from megatron_ba.integrations.nemo_aligner.overrides import recipe_to_nemo_overrides
from megatron_ba.integrations.verl_recipe import (
    ENTRY,
    recipe_to_verl_overrides,
    translation_notes,
    verl_command,
    verl_environment,
)
from megatron_ba.recipe import RecipeError, load_recipe
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
        "--cache-dir", default="runs/.cache", help="warm-start cache (default runs/.cache)"
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
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every library's output on the terminal (default: RUN_DIR/logs/rank-<r>.log)",
    )


def _nemo_aligner(recipe, args: argparse.Namespace, run_dir: Path) -> int:
    """backend=nemo_aligner: the recipe as NeMo-Aligner overrides; print them, or write the
    recipe's prompts (RUN_DIR/data/) and become its entry point (`python -m
    megatron_ba.integrations.nemo_aligner.train_grpo`, exec'd: a signal to this process reaches
    the training loop). NeMo logs, checkpoints and resumes in RUN_DIR: the same command again
    continues the run (NeMo moves the files it finds there into RUN_DIR/run_<N>/ first)."""
    import importlib.util

    hf = recipe.model.pretrained is not None and not recipe.model.pretrained.endswith(".nemo")
    files = prompt_file_paths(run_dir / "data")
    accelerator = _accelerator(args.accelerator)
    try:
        overrides = recipe_to_nemo_overrides(
            recipe,
            num_nodes=args.nodes,
            devices=args.devices,
            hf_checkpoint="placeholder" if args.print_overrides else "refuse",
            accelerator=accelerator,
            prompt_files=(str(files[0]), str(files[1])),
            log_dir=str(run_dir),
        )
    except ValueError as e:
        found = " (--accelerator auto: no GPU here; --accelerator gpu translates for GPU nodes)"
        print(f"train: {e}{found if args.accelerator != accelerator else ''}", file=sys.stderr)
        return 2
    if args.print_overrides:
        print("\n".join(overrides))
        print("train: the prompt files named above are written by the same command without "
              "--print-overrides, which then runs train_grpo with these overrides",
              file=sys.stderr)  # fmt: skip
        if hf:
            print(
                f"train: model.pretrained {recipe.model.pretrained!r} is a Hugging Face folder: "
                "convert it to .nemo with NeMo's converter (docs/nemo-aligner.md) and pass "
                "++pretrained_checkpoint.restore_from_path=FILE.nemo",
                file=sys.stderr,
            )
        return 0
    if importlib.util.find_spec("nemo_aligner") is None:
        print(
            "train: backend nemo_aligner needs NeMo-Aligner 0.7.0 in this environment (its "
            "container on GPUs; on CPU `bash scripts/setup_nemo_env.sh` makes .venv-nemo); "
            "--print-overrides shows what would be launched",
            file=sys.stderr,
        )
        return 2
    try:  # every process of the run writes the same files (atomically): no rank waits for one
        write_prompt_files(recipe, run_dir / "data")
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    entry = [sys.executable, "-m", "megatron_ba.integrations.nemo_aligner.train_grpo"]
    sys.stdout.flush()
    os.execv(sys.executable, [*entry, *overrides])


def _verl(recipe, args: argparse.Namespace, run_dir: Path) -> int:
    """backend=verl: the recipe as verl's ppo_megatron_trainer overrides; print them, or print the
    command (`python -m megatron_ba.integrations.verl.main_ppo --config-name ppo_megatron_trainer
    ...`) and become it (exec'd, with the MEGATRON_BA_* settings the recipe needs)."""
    try:
        overrides = recipe_to_verl_overrides(
            recipe,
            nodes=args.nodes,
            gpus_per_node=args.devices or 8,
            run_dir=str(run_dir.resolve()),  # verl's Ray processes need not share this cwd
        )
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    environment = verl_environment(recipe)
    launch = _EngineLaunch(
        "verl",
        verl_command("python", overrides, environment),
        [sys.executable, *ENTRY, *overrides],
        "verl 0.9.1 in this environment, with megatron-core and vLLM on GPU nodes (`pip install "
        "verl==0.9.1`, verl's docs for its GPU stack)",
    )
    if (status := launch.print_or_check(overrides, translation_notes(recipe), args)) is not None:
        return status
    launch.exec({**os.environ, **environment})


def _nemo_rl(recipe, args: argparse.Namespace, run_dir: Path) -> int:
    """backend=nemo_rl: the recipe as overrides of NeMo-RL's stock grpo_math_1B_megatron.yaml;
    print them, or write the validation prompt template (RUN_DIR/data/), print the command
    (`python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced --config ... overrides`) and
    become it (exec'd). The resolved recipe goes to RUN_DIR/recipe.yaml, checkpoints to
    RUN_DIR/checkpoints: the same command again, or `--resume RUN_DIR`, resumes."""
    run_dir = run_dir.resolve()  # NeMo-RL's Ray workers need not share this cwd
    try:
        overrides = nemo_rl_recipe.recipe_to_nemo_rl_overrides(
            recipe, nodes=args.nodes, gpus_per_node=args.devices or 8, run_dir=str(run_dir)
        )
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    config = nemo_rl_recipe.stock_config_path()
    launch = _EngineLaunch(
        "nemo_rl",
        nemo_rl_recipe.nemo_rl_command("python", config, overrides),
        [sys.executable, *nemo_rl_recipe.ENTRY, "--config", config, *overrides],
        "NeMo-RL v0.7.0 in this environment (its container on GPUs; on CPU `bash "
        "scripts/setup_nemorl_env.sh` makes .venv-nemorl)",
    )
    notes = nemo_rl_recipe.translation_notes(recipe)
    if (status := launch.print_or_check(overrides, notes, args)) is not None:
        return status
    _write_eval_prompt(recipe, Path(nemo_rl_recipe.eval_prompt_path(str(run_dir))))
    recipe.dump(run_dir / "recipe.yaml")  # `--resume RUN_DIR` reads it back
    launch.exec()


class _EngineLaunch:
    """How `train` hands a recipe to an engine (verl, NeMo-RL): print the translation's notes,
    then the overrides (--print-overrides) or the command; refuse where the engine's package is
    missing; else become the command."""

    def __init__(self, module: str, command: str, argv: list[str], needs: str) -> None:
        self.module, self.command, self.argv, self.needs = module, command, argv, needs

    def print_or_check(self, overrides: list[str], notes: list[str], args) -> int | None:
        """An exit status when nothing is launched (printed, or the engine missing); else None."""
        import importlib.util

        for note in notes:
            print(f"train: note: {note}", file=sys.stderr)
        if args.print_command:
            print(self.command)
            return 0
        if args.print_overrides:
            print("\n".join(overrides))
            print(f"train: the command that runs them: {self.command}", file=sys.stderr)
            return 0
        print(self.command)
        if importlib.util.find_spec(self.module) is None:
            print(
                f"train: backend {self.module} needs {self.needs}; --print-overrides shows what "
                "would be launched",
                file=sys.stderr,
            )
            return 2
        return None

    def exec(self, environment: dict[str, str] | None = None) -> None:
        """Become the command (with `environment` in place of this process's, if given)."""
        sys.stdout.flush()
        if environment is None:
            os.execv(sys.executable, self.argv)
        else:
            os.execve(sys.executable, self.argv, environment)


def _write_eval_prompt(recipe, path: Path) -> None:
    """eval.template as NeMo-RL's prompt_file: `{}` where its math processor puts the problem
    (`prompt.format(problem)`), the template's own braces doubled."""
    marker = "\x00"
    text = render_prompt(marker, recipe.eval.template).replace("{", "{{").replace("}", "}}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(marker, "{}"))


def _accelerator(choice: str) -> str:
    """--accelerator auto: a GPU where torch sees one, else the CPU (gloo processes)."""
    if choice != "auto":
        return choice
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    try:
        if args.resume:
            run_dir = Path(args.resume)
            saved = run_dir / "recipe.yaml"
            if not saved.is_file():
                print(f"train: --resume {run_dir}: no recipe.yaml there", file=sys.stderr)
                return 2
            recipe = load_recipe(saved, args.overrides)
        else:
            recipe = load_recipe(args.recipe, args.overrides)
            run_dir = Path(args.run_dir or f"runs/{recipe.name}-{recipe.loss.rule}")
    except RecipeError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    if args.print_command and recipe.backend not in ("verl", "nemo_rl"):
        print(f"train: --print-command is for backend=verl or nemo_rl, not {recipe.backend}",
              file=sys.stderr)  # fmt: skip
        return 2
    if recipe.backend == "nemo_aligner":
        return _nemo_aligner(recipe, args, run_dir)
    if recipe.backend == "verl":
        return _verl(recipe, args, run_dir)
    if recipe.backend == "nemo_rl":
        return _nemo_rl(recipe, args, run_dir)
    if args.print_overrides:
        print("train: --print-overrides is for backend=nemo_aligner, verl or nemo_rl",
              file=sys.stderr)  # fmt: skip
        return 2
    # torch: imported on use, so that --help imports none
    from megatron_ba.train import preemption

    rank = int(os.environ.get("RANK", "0"))
    console = Console(run_dir / "logs", rank=rank, verbose=args.verbose)
    preemption.install()  # SIGUSR1: checkpoint at the next step boundary and stop
    with console:  # before the heavy imports: their warnings go to the log file too
        # torch: imported on use, so that --help imports none
        from megatron_ba.train.driver import Trainer

        log = console.log if rank == 0 else (lambda _msg: None)
        trainer = Trainer(
            recipe, run_dir, resume=bool(args.resume), cache_dir=Path(args.cache_dir), log=log
        )
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
