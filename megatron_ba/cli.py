"""The `megatron-ba` command line.

    megatron-ba --help                 # list the subcommands
    megatron-ba weights --help         # help of one subcommand

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their subcommand runs, and at module level they import nothing
heavy (torch, megatron-core, vLLM are imported inside `run`): `--help` and argument errors of
every command answer without them (tests/test_cli_help.py).

A user error (errors.UserError: a bad recipe, data set, path or option) that reaches `main`
prints its message alone on stderr, exit status 2, like an argument error. Any other exception
keeps its traceback: that is a bug (tests/test_cli_errors.py). In N processes (`megatron-ba train
--nproc-per-node N`, or torchrun) rank 0 says it and the others stay quiet
(parallel/local_launch.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_ba.errors import UserError
from megatron_ba.parallel import local_launch

# name -> (module, one-line help). Later features register here.
COMMANDS: dict[str, tuple[str, str]] = {
    "weights": (
        "megatron_ba.commands.weights",
        "show the per-sequence weights of every aggregation rule for a small GRPO batch",
    ),
    "check-layout": (
        "megatron_ba.commands.check_layout",
        "check a TP x PP x CP x DP layout's loss and gradients against a single process (gloo)",
    ),
    "train": (
        "megatron_ba.commands.train",
        "run GRPO from a recipe (the CPU main job: recipes/tiny-cpu.yaml)",
    ),
    "compare": (
        "megatron_ba.commands.compare",
        "train token (per-group and pooled) / sequence / balanced on one recipe, with a report",
    ),
    "study": (
        "megatron_ba.commands.study",
        "train a recipe over a grid of keys (here or as one Slurm job array) and report it",
    ),
    "report": (
        "megatron_ba.commands.report",
        "report.md of a study or of run folders: seeds' spread, rule pairs, length diagnostics",
    ),
    "eval": (
        "megatron_ba.commands.eval",
        "Acc@k / Best@k of a Hugging Face model folder on the paper's six benchmarks (vLLM)",
    ),
    "convert": (
        "megatron_ba.commands.convert",
        "Hugging Face Qwen2/Qwen3/Qwen3-MoE folder <-> megatron-core distributed checkpoint",
    ),
    "tiny-model": (
        "megatron_ba.commands.tiny_model",
        "write a tiny random Qwen3 / Qwen2 / Qwen3-MoE HF checkpoint and tokenizer (offline)",
    ),
    "nemo-tiny-model": (
        "megatron_ba.commands.nemo_tiny_model",
        "write a tiny NeMo GPT (.nemo, the tiny recipe's warm start) and its prompts (NeMo 2.1)",
    ),
    "layout": (
        "megatron_ba.commands.layout",
        "propose TP/PP/CP/DP and micro-batches that fit a cluster, with a per-GPU memory estimate",
    ),
    "perf": (
        "megatron_ba.commands.perf",
        "run a speed / memory measurement (aggregation, step, refit, ...) and print it",
    ),
}
# Former names, still accepted: each says what the command is called now, then runs it.
ALIASES: dict[str, tuple[str, str]] = {
    "plan": ("weights", "it shows every rule's per-sequence weights"),
    "bench": ("perf", "'benchmark' means the evaluation sets; these measure speed and memory"),
}


def _top_level_help() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: megatron-ba COMMAND [options]",
        "",
        "Balanced Aggregation for GRPO on megatron-core.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  {old:<{width}}  the former name of `{new}`" for old, (new, _) in ALIASES.items()]
    lines += ["", "Run `megatron-ba COMMAND --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in ALIASES:
        new, why = ALIASES[name]
        print(f"megatron-ba {name}: now `megatron-ba {new}` ({why})", file=sys.stderr)
        name = new
    if name not in COMMANDS:
        print(f"megatron-ba: unknown command {name!r}\n\n{_top_level_help()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"megatron-ba {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    # --nproc-per-node N (train, convert): the command again in N processes under torchrun's
    # launcher; inside them (torchrun's or these) the option has done its work.
    if getattr(args, "nproc_per_node", 1) > 1 and not local_launch.in_launched_worker():
        return local_launch.run_local(args.nproc_per_node, [name, *rest])
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        local_launch.report_user_error(str(e))  # once, from rank 0, under torchrun too
        return local_launch.USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
