"""What `megatron-ba train RECIPE backend=verl|nemo_rl|nemo_aligner` does after translating: print
the translation, or write what the run needs into its folder and become the engine's command.

    status = launch(recipe, run_dir, LaunchOptions(print_overrides=True), run_files)

Every engine's command is exec'd (the process becomes it: a signal to `megatron-ba train`, a
Slurm preemption warning among them, reaches the engine's loop). Before that the translation's
notes go to stderr and the command to stdout (verl, NeMo-RL: the Slurm launcher reads it with
--print-command); where the engine's package does not import, the command is printed and the
run refused (exit status 2) with what to install. A recipe key the engine cannot honour is
refused (exit status 2) before anything is printed or written.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ba.integrations.engines import nemo_aligner, nemo_rl, verl


@dataclass(frozen=True)
class LaunchOptions:
    """The options of `megatron-ba train` an engine's launch reads."""

    print_overrides: bool = False
    print_command: bool = False
    nodes: int = 1
    devices: int | None = None
    accelerator: str = "auto"  # NeMo-Aligner: gpu, cpu, or auto (gpu where torch sees one)


@dataclass(frozen=True)
class RunFiles:
    """What the command layer hands the launch to write into the run folder: the recipe's
    prompt files (NeMo-Aligner trains on them) and its prompt template (NeMo-RL's validation
    prompt_file). They are made by the local backend's task code, which the engines' package
    does not import (adapters know no local driver), so the command passes them in."""

    prompt_paths: Callable[[Path], tuple[Path, Path]]  # the train and validation file's paths
    write_prompts: Callable[[Any, Path], object]  # write both under a folder
    render_prompt: Callable[[str, str], str]  # a problem in a template (data/templates.py)


def launch(recipe, run_dir: Path, options: LaunchOptions, files: RunFiles) -> int:
    """Run `recipe` on its backend's engine (an exit status when nothing is exec'd)."""
    if recipe.backend == "nemo_aligner":
        return _nemo_aligner(recipe, run_dir, options, files)
    if recipe.backend == "verl":
        return _verl(recipe, run_dir, options)
    if recipe.backend == "nemo_rl":
        return _nemo_rl(recipe, run_dir, options, files)
    raise ValueError(f"backend: no engine launches {recipe.backend!r}")


class _EngineCommand:
    """An engine's command: printed with the translation's notes, refused where the engine's
    package is missing, else exec'd."""

    def __init__(self, module: str, command: str, argv: list[str], needs: str) -> None:
        self.module, self.command, self.argv, self.needs = module, command, argv, needs

    def print_or_check(self, overrides: list[str], notes: list[str], options) -> int | None:
        """An exit status when nothing is launched (printed, or the engine missing); else None."""
        for note in notes:
            print(f"train: note: {note}", file=sys.stderr)
        if options.print_command:
            print(self.command)
            return 0
        if options.print_overrides:
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


def _verl(recipe, run_dir: Path, options: LaunchOptions) -> int:
    """The recipe as verl's ppo_megatron_trainer overrides; the command (`python -m
    megatron_ba.integrations.verl.main_ppo --config-name ppo_megatron_trainer ...`) runs with
    the MEGATRON_BA_* settings the recipe needs in its environment."""
    try:
        overrides = verl.recipe_to_verl_overrides(
            recipe,
            nodes=options.nodes,
            gpus_per_node=options.devices or 8,
            run_dir=str(run_dir.resolve()),  # verl's Ray processes need not share this cwd
        )
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    environment = verl.verl_environment(recipe)
    command = _EngineCommand(
        "verl",
        verl.verl_command("python", overrides, environment),
        [sys.executable, *verl.ENTRY, *overrides],
        "verl 0.9.1 in this environment, with megatron-core and vLLM on GPU nodes (`pip install "
        "verl==0.9.1`, verl's docs for its GPU stack)",
    )
    notes = verl.translation_notes(recipe)
    if (status := command.print_or_check(overrides, notes, options)) is not None:
        return status
    command.exec({**os.environ, **environment})


def _nemo_rl(recipe, run_dir: Path, options: LaunchOptions, files: RunFiles) -> int:
    """The recipe as overrides of NeMo-RL's stock grpo_math_1B_megatron.yaml; before the command
    (`python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced --config ... overrides`) the
    validation prompt template goes to RUN_DIR/data/ and the resolved recipe to
    RUN_DIR/recipe.yaml: the same command again, or `--resume RUN_DIR`, resumes from
    RUN_DIR/checkpoints."""
    run_dir = run_dir.resolve()  # NeMo-RL's Ray workers need not share this cwd
    try:
        overrides = nemo_rl.recipe_to_nemo_rl_overrides(
            recipe, nodes=options.nodes, gpus_per_node=options.devices or 8, run_dir=str(run_dir)
        )
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    config = nemo_rl.stock_config_path()
    command = _EngineCommand(
        "nemo_rl",
        nemo_rl.nemo_rl_command("python", config, overrides),
        [sys.executable, *nemo_rl.ENTRY, "--config", config, *overrides],
        "NeMo-RL v0.7.0 in this environment (its container on GPUs; on CPU `bash "
        "scripts/setup_nemorl_env.sh` makes .venv-nemorl)",
    )
    notes = nemo_rl.translation_notes(recipe)
    if (status := command.print_or_check(overrides, notes, options)) is not None:
        return status
    _write_eval_prompt(recipe, Path(nemo_rl.eval_prompt_path(str(run_dir))), files.render_prompt)
    recipe.dump(run_dir / "recipe.yaml")  # `--resume RUN_DIR` reads it back
    command.exec()


def _write_eval_prompt(recipe, path: Path, render_prompt) -> None:
    """eval.template as NeMo-RL's prompt_file: `{}` where its math processor puts the problem
    (`prompt.format(problem)`), the template's own braces doubled."""
    marker = "\x00"
    text = render_prompt(marker, recipe.eval.template).replace("{", "{{").replace("}", "}}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(marker, "{}"))


def _nemo_aligner(recipe, run_dir: Path, options: LaunchOptions, files: RunFiles) -> int:
    """The recipe as NeMo-Aligner overrides; printed, or the recipe's prompts written to
    RUN_DIR/data/ and the process become its entry point (`python -m
    megatron_ba.integrations.nemo_aligner.train_grpo`). NeMo logs, checkpoints and resumes in
    RUN_DIR: the same command again continues the run (NeMo moves the files it finds there into
    RUN_DIR/run_<N>/ first)."""
    prompts = files.prompt_paths(run_dir / "data")
    accelerator = _accelerator(options.accelerator)
    try:
        overrides = nemo_aligner.recipe_to_nemo_overrides(
            recipe,
            num_nodes=options.nodes,
            devices=options.devices,
            hf_checkpoint="placeholder" if options.print_overrides else "refuse",
            accelerator=accelerator,
            prompt_files=(str(prompts[0]), str(prompts[1])),
            log_dir=str(run_dir),
        )
    except ValueError as e:
        found = " (--accelerator auto: no GPU here; --accelerator gpu translates for GPU nodes)"
        print(f"train: {e}{found if options.accelerator != accelerator else ''}", file=sys.stderr)
        return 2
    if options.print_overrides:
        _print_nemo_overrides(recipe, overrides)
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
        files.write_prompts(recipe, run_dir / "data")
    except ValueError as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *nemo_aligner.ENTRY, *overrides])


def _print_nemo_overrides(recipe, overrides: list[str]) -> None:
    print("\n".join(overrides))
    print(
        "train: the prompt files named above are written by the same command without "
        "--print-overrides, which then runs train_grpo with these overrides",
        file=sys.stderr,
    )
    pretrained = recipe.model.pretrained
    if pretrained is not None and not pretrained.endswith(".nemo"):
        print(
            f"train: model.pretrained {pretrained!r} is a Hugging Face folder: convert it to "
            ".nemo with NeMo's converter (docs/nemo-aligner.md) and pass "
            "++pretrained_checkpoint.restore_from_path=FILE.nemo",
            file=sys.stderr,
        )


def _accelerator(choice: str) -> str:
    """--accelerator auto: a GPU where torch sees one, else the CPU (gloo processes)."""
    if choice != "auto":
        return choice
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"
