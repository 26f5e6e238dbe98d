"""`megatron-ba report DIR`: report.md, report.json and figures/ of a study or of run folders.

    megatron-ba report runs/study                       # a study's folder (its study.json)
    megatron-ba report copied-runs/ --keys loss.rule,seed,grpo.max_new_tokens

DIR is a study's folder, or any folder whose subfolders are run folders (recipe.yaml and
metrics.jsonl) of one recipe: their recipes may differ only in the swept keys (the study's; else
--keys, default loss.rule,seed). studies/reporting.py says what the report holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="a study folder, or a folder of run folders")
    p.add_argument(
        "--keys",
        default=None,
        help="the swept recipe keys, comma-separated (without study.json; default loss.rule,seed)",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_ba.studies.reporting import write_report

    if not args.folder.is_dir():
        print(f"report: {args.folder}: not a folder", file=sys.stderr)
        return 2
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    try:
        print(f"report: {write_report(args.folder, keys)}")
    except ValueError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    return 0
