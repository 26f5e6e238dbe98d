"""Reading tables through `datasets`: a hub id or a local parquet/jsonl/json file or folder.

    rows = open_table("BytedTsinghua-SIA/DAPO-Math-17k", split="train")   # hub (cluster)
    rows = open_table("data/dapo-math-17k.parquet")                      # local file
    require_columns(rows, ["prompt", "reward_model.ground_truth"], name="DAPO-Math-17k")

`datasets` is imported here only (the `data` extra). Rows are iterated in batches so that the
1.8M-row DAPO file never becomes one Python list.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from megatron_ba.data.records import SchemaError
from megatron_ba.errors import UserError

LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def _local_files(path: Path) -> tuple[str, list[str]]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS and p.is_file())
        if not files:
            raise UserError(f"source folder {path} holds no .parquet/.jsonl/.json file")
    suffixes = {p.suffix for p in files}
    if len(suffixes) != 1 or files[0].suffix not in LOCAL_BUILDERS:
        raise UserError(
            f"source {path}: expected .parquet, .jsonl or .json files of one kind, got {suffixes}"
        )
    return LOCAL_BUILDERS[files[0].suffix], [str(p) for p in files]


def is_local(source: str | Path) -> bool:
    return Path(source).exists()


@contextlib.contextmanager
def _quiet(datasets):
    """`datasets` without its progress bars and below-critical log lines, then as it was."""
    verbosity = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars:
            datasets.enable_progress_bars()


def _unreadable(builder: str, files: list[str], error: Exception) -> str:
    """What is wrong with local files `datasets` could not read: for JSON Lines the first line
    that is no JSON object (a file cut short, a partial copy), else pyarrow's own words."""
    if builder == "json":
        for name in files:
            with open(name, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    try:
                        json.loads(line) if line.strip() else None
                    except json.JSONDecodeError as bad:
                        return (
                            f"{name}: line {number} is not a JSON record ({bad.msg}): a file cut "
                            "short or a partial copy? Copy it again"
                        )
    cause = error.__cause__ or error
    return f"{', '.join(files)}: not readable as {builder} ({str(cause).splitlines()[0]})"


def open_table(source: str | Path, *, split: str = "train", config: str | None = None):
    """A `datasets.Dataset` from a hub id (with `config`, `split`) or a local file/folder."""
    import datasets

    if is_local(source):
        builder, files = _local_files(Path(source))
        try:
            with _quiet(datasets):  # a file it cannot parse: our one line, not its log and bar
                return datasets.load_dataset(builder, data_files=files, split="train")
        except datasets.exceptions.DatasetGenerationError as e:  # pyarrow could not parse it
            raise UserError(_unreadable(builder, files, e)) from None
    if not isinstance(source, str) or "/" not in source:
        raise UserError(f"source {source!r} is neither an existing path nor a hub id 'org/name'")
    if Path(source).suffix in LOCAL_BUILDERS or source.startswith(("/", "./", "../", "~")):
        raise UserError(f"source {source!r}: no such file or folder (a hub id is 'org/name')")
    try:
        return datasets.load_dataset(source, config, split=split)
    except ConnectionError as e:  # no network (or HF_HUB_OFFLINE): say what to do instead
        raise ConnectionError(
            f"source {source!r}: not a local path, and the hub cannot be reached ({e}); "
            f"download the data set once and pass its local file or folder"
        ) from e


def _has_path(features, dotted: str) -> bool:
    head, *rest = dotted.split(".")
    if head not in features:
        return False
    if not rest:
        return True
    sub = features[head]
    return isinstance(sub, dict) and _has_path(sub, ".".join(rest))


def require_columns(table, columns: list[str], *, name: str) -> None:
    """Raise SchemaError naming the first missing column (dotted names reach into structs)."""
    features = table.features
    for col in columns:
        if not _has_path(features, col):
            raise SchemaError(
                f"{name}: missing column {col!r}; the table has columns {sorted(features)}"
            )


def first_present(table, candidates: list[str], *, name: str, what: str) -> str:
    """The first of `candidates` that the table has, or SchemaError listing them all."""
    for col in candidates:
        if col in table.features:
            return col
    raise SchemaError(
        f"{name}: missing {what} column (expected one of {candidates}); "
        f"the table has columns {sorted(table.features)}"
    )


def iter_rows(table, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[dict]:
    """Rows as dicts, read `batch_size` at a time (only `columns` if given)."""
    if columns is not None:
        table = table.select_columns(columns)
    for batch in table.iter(batch_size=batch_size):
        keys = list(batch)
        for i in range(len(batch[keys[0]]) if keys else 0):
            yield {k: batch[k][i] for k in keys}
