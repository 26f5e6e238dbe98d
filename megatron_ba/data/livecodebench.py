"""LiveCodeBench `code_generation_lite`, read from its JSONL files (its loading script no longer
runs under current `datasets`), or from one JSON array of the same records (how several public
evaluation repos save it); anything else is a SchemaError saying what is expected.

    from megatron_ba.data.livecodebench import load_livecodebench
    lcb = load_livecodebench("lcb/", version="release_v5", since="2024-08-01")

Rows: question_title, question_content, platform, question_id, contest_id, contest_date,
starter_code, difficulty, public_test_cases (JSON text), private_test_cases (JSON text, or
base64 of zlib of a pickle of that JSON text), metadata (JSON text; "func_name" for functional
problems). Versions are cumulative files: release_vN = test.jsonl, test2.jsonl .. testN.jsonl.
Private tests are decoded with an unpickler that refuses every global: a pickle can only yield
plain str/bytes/numbers/lists/dicts, never call anything.

rllm's layout is read too, record by record (a record with `problem` and no `question_content`).
rllm (rllm/data/preprocess/code/livecodebench.ipynb) writes one JSON array of

    {"problem": question_content, "starter_code": starter_code,
     "tests": public + private test cases, decoded ([{input, output, testtype}]),
     "metadata": the metadata, parsed ({} or {"func_name": ...})}

which maps back field by field; `tests` and `metadata` may also be JSON text (DeepCoder's
parquet keeps them so). rllm's metadata is often {} for a functional problem: its function
is then the one method of class Solution in starter_code, which LeetCode's stub declares
(`class Solution:` then `def NAME(self, ...)`). rllm's layout has no question_id (a record is
named FILE#K, K its position), and no contest_date: `since` / `until` cannot select from it
and are refused (rllm cuts its files to a date window when it writes them).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from pathlib import Path

from megatron_ba.data.records import LoadedSet, LoadReport, Problem, SchemaError
from megatron_ba.errors import UserError

HUB_ID = "livecodebench/code_generation_lite"
REQUIRED = ("question_content", "public_test_cases", "private_test_cases", "question_id")
RLLM_REQUIRED = ("problem", "tests")  # rllm also writes starter_code and metadata
TESTTYPES = ("stdin", "functional")
MAX_DECOMPRESSED = 512 << 20  # a zlib bomb stops here


def version_files(version: str) -> list[str]:
    """release_vN -> the N cumulative JSONL files."""
    try:
        n = int(version.removeprefix("release_v"))
        if not version.startswith("release_v") or n < 1:
            raise ValueError
    except ValueError:
        raise UserError(f"version must look like 'release_v5', got {version!r}") from None
    return ["test.jsonl"] + [f"test{k}.jsonl" for k in range(2, n + 1)]


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} from test data")


def decode_test_cases(text: str) -> list[dict]:
    """LiveCodeBench test cases from JSON text or base64(zlib(pickle(JSON text)))."""
    if not isinstance(text, str):
        raise ValueError(f"test cases must be text, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        return []
    if stripped.startswith("["):
        value = json.loads(stripped)
    else:
        try:
            packed = base64.b64decode(stripped, validate=False)
            inflater = zlib.decompressobj()
            raw = inflater.decompress(packed, MAX_DECOMPRESSED)
            if inflater.unconsumed_tail:
                raise ValueError(f"decompressed test cases exceed {MAX_DECOMPRESSED} bytes")
            value = _PlainUnpickler(io.BytesIO(raw)).load()
        except (zlib.error, pickle.UnpicklingError, EOFError, ValueError) as exc:
            raise ValueError(f"private test cases could not be decoded: {exc}") from exc
        if isinstance(value, bytes):
            value = value.decode()
        if isinstance(value, str):
            value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise ValueError("test cases must decode to a list of {input, output, testtype} dicts")
    return value


def _files(source: str | Path | None, version: str) -> list[Path]:
    wanted = version_files(version)
    if source is None:
        from huggingface_hub import hf_hub_download

        return [Path(hf_hub_download(HUB_ID, f, repo_type="dataset")) for f in wanted]
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = [path / f for f in wanted if (path / f).is_file()]
        if not found:
            found = sorted(path.glob("*.jsonl")) or sorted(path.glob("*.json"))
        if found:
            return found
        raise UserError(
            f"LiveCodeBench folder {path} holds none of {wanted} and no .jsonl or .json file"
        )
    raise UserError(f"LiveCodeBench source {source!r} does not exist")


EXPECTED = (
    "JSON Lines (one object per line, as LiveCodeBench ships test.jsonl ...) or one JSON array "
    f"of such objects, with LiveCodeBench's columns {', '.join(REQUIRED)} (or rllm's "
    f"{', '.join(RLLM_REQUIRED)}, starter_code, metadata)"
)


def _first_char(f) -> str:
    while True:
        c = f.read(1)
        if not c or not c.isspace():
            return c


def _records(path: Path):
    """(where, row) of every record of a JSONL file or of a file holding one JSON array."""
    with open(path, encoding="utf-8") as f:
        is_array = _first_char(f) == "["
        f.seek(0)
        if is_array:  # several public evaluation repos save the list whole
            try:
                rows = json.load(f)
            except json.JSONDecodeError as exc:
                raise SchemaError(
                    f"LiveCodeBench {path.name}: starts like a JSON array but is not valid "
                    f"JSON ({exc}); expected {EXPECTED}"
                ) from exc
            for k, row in enumerate(rows):
                yield f"LiveCodeBench {path.name}: record {k}", row
            return
        for line_no, line in enumerate(f, 1):  # streamed: the files reach gigabytes
            if not line.strip():
                continue
            where = f"LiveCodeBench {path.name}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SchemaError(
                    f"{where}: not a JSON object ({exc}); expected {EXPECTED}"
                ) from exc
            yield where, row


def _is_rllm(row: dict) -> bool:
    return "problem" in row and "question_content" not in row


def _check_record(where: str, row) -> None:
    if not isinstance(row, dict):
        raise SchemaError(f"{where}: a {type(row).__name__}, not an object; expected {EXPECTED}")
    required = RLLM_REQUIRED if _is_rllm(row) else REQUIRED
    missing = [c for c in required if c not in row]
    if missing:
        raise SchemaError(
            f"{where}: missing column {missing[0]!r} (missing {missing}; the record has "
            f"{sorted(row)}); expected {EXPECTED}"
        )


def _json_field(where: str, row: dict, column: str, default):
    """A column holding a value or the JSON text of one."""
    value = row.get(column)
    if value is None or value == "":
        return default
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"{where}: {column} is not valid JSON ({exc})") from exc
    return value


_SOLUTION = re.compile(r"^class[ \t]+Solution\b[^\n]*:[ \t]*(?:#[^\n]*)?$", re.M)
_METHOD = re.compile(r"^[ \t]+def[ \t]+([A-Za-z_]\w*)[ \t]*\([ \t]*self\b", re.M)


def solution_methods(starter_code: str) -> list[str]:
    """The methods (taking self) of class Solution in a LeetCode stub; [] without that class.

    Read as text, not parsed: a stub ends in a method without a body, which is no valid Python.
    The class ends at the next line that starts in the first column (comments aside)."""
    found = _SOLUTION.search(starter_code or "")
    if not found:
        return []
    body = starter_code[found.end() :]
    end = re.search(r"^[^\s#]", body, re.M)
    return _METHOD.findall(body[: end.start()] if end else body)


def _func_name(where: str, name: str, meta, starter_code: str, tests: list[dict]) -> str | None:
    """metadata.func_name, else the one method of class Solution in starter_code; a SchemaError
    naming the problem when functional tests have neither."""
    func_name = meta.get("func_name") if isinstance(meta, dict) else None
    if func_name or not any(c.get("testtype") == "functional" for c in tests):
        return func_name or None
    methods = solution_methods(starter_code)
    if len(methods) == 1:
        return methods[0]
    found = (
        f"its class Solution defines {len(methods)} methods ({', '.join(methods)})"
        if methods
        else "its starter_code has no method of class Solution"
    )
    raise SchemaError(
        f"{where} ({name}): functional tests need a function name: metadata.func_name is "
        f"absent and {found}"
    )


def _lcb_problem(where: str, row: dict) -> Problem:
    """A record in LiveCodeBench's own layout."""
    try:
        tests = decode_test_cases(row["public_test_cases"]) + decode_test_cases(
            row["private_test_cases"]
        )
    except ValueError as exc:
        raise SchemaError(f"{where}: {exc}") from exc
    meta = _json_field(where, row, "metadata", {})
    return Problem(
        str(row["question_id"]),
        row["question_content"],
        kind="code",
        tests=tuple(tests),
        func_name=_func_name(
            where, str(row["question_id"]), meta, row.get("starter_code") or "", tests
        ),
        starter_code=row.get("starter_code") or "",
        source="livecodebench",
        meta={
            "contest_date": str(row.get("contest_date") or ""),
            "difficulty": row.get("difficulty"),
        },
    )


def _rllm_problem(where: str, name: str, row: dict) -> Problem:
    """A record in rllm's layout (module docstring): the same fields under rllm's names."""
    tests = _json_field(where, row, "tests", [])
    ok = isinstance(tests, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("input"), str)
        and isinstance(c.get("output"), str)
        and c.get("testtype", "stdin") in TESTTYPES
        for c in tests
    )
    if not ok:
        raise SchemaError(
            f"{where}: tests must be a list of {{input: str, output: str, testtype: "
            f"{' | '.join(TESTTYPES)}}} objects (rllm's layout)"
        )
    if not isinstance(row["problem"], str):
        raise SchemaError(f"{where}: problem must be text, got {type(row['problem']).__name__}")
    meta = _json_field(where, row, "metadata", {})
    if not isinstance(meta, dict):
        raise SchemaError(f"{where}: metadata must be an object, got {type(meta).__name__}")
    func_name = _func_name(where, name, meta, row.get("starter_code") or "", tests)
    return Problem(
        name,
        row["problem"],
        kind="code",
        tests=tuple(tests),
        func_name=func_name,
        starter_code=row.get("starter_code") or "",
        source="livecodebench",
        meta={"contest_date": "", "difficulty": None, "layout": "rllm"},
    )


def load_livecodebench(
    source: str | Path | None = None,
    *,
    version: str = "release_v5",
    since: str | None = None,
    until: str | None = None,
) -> LoadedSet:
    """Code Problems with public + private tests; `since`/`until` filter contest_date (ISO,
    inclusive, compared as text: "2024-08-01" <= "2024-08-01T00:00:00")."""
    report = LoadReport("LiveCodeBench", str(source or HUB_ID))
    problems = []
    for path in _files(source, version):
        for k, (where, row) in enumerate(_records(path)):
            _check_record(where, row)
            report.rows_read += 1
            if _is_rllm(row) and (since or until):
                raise SchemaError(
                    f"{where}: rllm's layout has no contest_date, so since/until (--lcb-since, "
                    "--lcb-until) cannot select from it; leave them out (rllm cuts its files to "
                    "a date window when it writes them)"
                )
            date = str(row.get("contest_date") or "")
            if (since and date[: len(since)] < since) or (until and date[: len(until)] > until):
                report.drop("contest date out of range")
                continue
            try:
                if _is_rllm(row):
                    problems.append(_rllm_problem(where, f"{path.name}#{k}", row))
                else:
                    problems.append(_lcb_problem(where, row))
            except SchemaError:
                raise
            except ValueError as exc:  # Problem's own checks: an empty question, no tests
                raise SchemaError(f"{where}: {exc}") from exc
    report.kept = len(problems)
    return LoadedSet(problems, report)
