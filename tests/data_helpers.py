"""Shared by the data / rewards / eval tests: offline settings and fixture paths.

Importing this module forbids any hub access for the libraries that would try it.
"""

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BENCH = FIXTURES / "bench"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def without_column(src: Path, dst: Path, column: str) -> Path:
    """A copy of a JSONL fixture with `column` removed from every row (a broken schema)."""
    return write_jsonl(dst, [{k: v for k, v in r.items() if k != column} for r in read_jsonl(src)])
