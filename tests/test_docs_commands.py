"""The documentation's commands, links and scripts exist: parsed and looked up, never run.

    python -m pytest tests/test_docs_commands.py      # a few seconds: imports the parsers only

Pages: README.md, docs/*.md, slurm/README.md, and the comments of recipes/*.yaml.

- Every `megatron-ba ...` command line (and `-m megatron_ba.cli ...`) in a fenced or indented
  code block, an inline code span or a recipe comment (the `# layout:` lines included) names a
  subcommand of megatron_ba/cli.py, and every `--flag` it uses is an option string of that
  subcommand's argparse parser, built as cli.py builds it (`megatron-ba perf NAME`: of the
  benchmark's own parser), and one that its `--help` lists (not argparse.SUPPRESS).
  Placeholders in capitals (`megatron-ba COMMAND --help`) stand for any subcommand, so they may
  use only `--help`. Abbreviated flags, which argparse would accept,
  count as unknown: a page spells a flag out.
- Every relative link `[text](path)` / `[text](path#anchor)` of a page points to a file that
  exists; an anchor into a markdown file names one of its headings (GitHub's rule: lowercase,
  punctuation other than `-` and `_` dropped, spaces to `-`, `-1`, `-2` ... for repeats).
- Every `bash scripts/X.sh`, `bash slurm/X.sh` and `sbatch ... slurm/X.sh` a page mentions,
  every `megatron_ba/`, `requirements/` and `docs/` path a page or recipe names,
  and every `tests/....py` that a page, a recipe or a module of megatron_ba/ or scripts/ names,
  exists.
- No file of the repository refers to a numbered issue: the project speaks of itself.

Each checker is also run on planted text that it must reject.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
from pathlib import Path
from unittest import mock

import pytest

from megatron_ba.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "slurm/README.md"])
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- markdown: code blocks, inline code spans, prose ----------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def split_markdown(text: str) -> tuple[list[str], str]:
    """(code lines, prose): lines of fenced and indented code blocks, and the rest of the page
    with those lines blanked (inline code spans and links are read from the prose)."""
    code, prose = [], []
    fence = None
    previous_blank_or_code = True
    for line in text.splitlines():
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            else:
                code.append(line)
            prose.append("")
            continue
        m = FENCE.match(line)
        if m:
            fence = m.group(1)
            prose.append("")
            previous_blank_or_code = False
            continue
        indented = line.startswith(("    ", "\t")) and line.strip() != ""
        if indented and previous_blank_or_code:
            code.append(line)
            prose.append("")
            continue
        previous_blank_or_code = line.strip() == ""
        prose.append(line)
    return code, "\n".join(prose)


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def inline_code_spans(prose: str) -> list[str]:
    """The contents of the inline code spans (which may run over a line break), one line each."""
    return [" ".join(m.group(2).split()) for m in INLINE_CODE.finditer(prose)]


def join_continuations(lines: list[str]) -> list[str]:
    """Shell lines with their trailing-backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    if pending:
        out.append(pending)
    return out


# --- command lines ------------------------------------------------------------------------

# `megatron-ba` as a command word (not `~/.cache/megatron-ba/`, `megatron-ba.sqsh`,
# `megatron-ba[trl]`), or the module form `-m megatron_ba.cli`.
COMMAND_START = re.compile(r"(?<![\w./-])(?:megatron-ba|-m megatron_ba\.cli)(?=\s)")
# Where a command line ends: a shell comment, a separator or pipe, a closing backtick.
COMMAND_END = re.compile(r"\s#|;|&&|\||`")


def commands_in(line: str) -> list[str]:
    """Every command line that starts in `line`, each cut where the shell would end it or the
    next one starts (a comment `... # then: megatron-ba eval ...` holds a second one)."""
    text = line.replace("\\|", "/")  # a markdown table's escaped pipe, as in `--to megatron\|hf`
    starts = [m.start() for m in COMMAND_START.finditer(text)]
    found = []
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else len(text)
        body = text[start:stop]
        head = "megatron-ba" if body.startswith("megatron-ba") else "-m megatron_ba.cli"
        rest = body[len(head) :]
        end = COMMAND_END.search(rest)
        rest = rest[: end.start()] if end else rest
        if rest.split():
            found.append("megatron-ba " + " ".join(rest.split()))
    return found


def table_row_flags(prose: str) -> list[str]:
    """In a table row that shows a `megatron-ba SUB ...` command, the spans that are flags alone
    (`--resume RUN_DIR`, `--token-budget T`) belong to SUB: each as `megatron-ba SUB FLAGS`."""
    found = []
    for row in prose.splitlines():
        if not row.lstrip().startswith("|"):
            continue
        prefix = None
        for span in inline_code_spans(row):
            commands = commands_in(span)
            if commands:
                words = commands[-1].split()
                named = len(words) > 2 and words[1] == "perf" and not words[2].startswith("-")
                prefix = " ".join(words[: 3 if named else 2])
            elif prefix and span.startswith("--"):
                found.append(f"{prefix} {span.replace(chr(92) + '|', '/')}")
    return found


def markdown_commands(text: str) -> list[str]:
    """Every command line of a page: code blocks first, then inline spans, then the flags of
    table rows (`table_row_flags`)."""
    code, prose = split_markdown(text)
    lines = join_continuations(code) + inline_code_spans(prose)
    return [c for line in lines for c in commands_in(line)] + table_row_flags(prose)


def recipe_comments(text: str) -> list[str]:
    """The comment text of a YAML file: whole-line comments and trailing ` # ...` ones."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            out.append(line.lstrip()[1:])
        elif " #" in line:
            out.append(line.split(" #", 1)[1])
    return out


def recipe_commands(text: str) -> list[str]:
    return [c for line in recipe_comments(text) for c in commands_in(line)]


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The flags `--help` lists: a page may not send a reader to one that --help hides."""
    return {
        s
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for s in action.option_strings
    }


@functools.cache
def subcommand_options(name: str) -> frozenset[str]:
    """The option strings of `megatron-ba NAME`, its parser built as megatron_ba/cli.py does."""
    module_name, help_ = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"megatron-ba {name}", description=help_)
    importlib.import_module(module_name).add_arguments(parser)
    return frozenset(_option_strings(parser))


class _Parsed(Exception):
    """Raised instead of parsing: carries the parser a benchmark's main() built."""


@functools.cache
def benchmark_options(name: str) -> frozenset[str]:
    """The option strings of `megatron-ba perf NAME`: the parser its module's main() builds,
    caught at its parse_args call (nothing runs)."""
    from megatron_ba.commands.perf import PERF

    module = importlib.import_module(PERF[name][0])

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            module.main([])
        except _Parsed as parsed:
            return frozenset(_option_strings(parsed.args[0]))
    raise AssertionError(f"bench {name}: main() never parsed its arguments")


FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")


def _placeholder(word: str) -> bool:
    return re.fullmatch(r"[A-Z][A-Z0-9_]*", word) is not None


def command_problems(command: str) -> list[str]:
    """Why `megatron-ba ...` would not parse: an unknown subcommand or benchmark, or a flag its
    parser does not define. Empty when it parses."""
    words = command.split()[1:]
    if not words or (words[0] in ("-h", "--help") and len(words) == 1):
        return []
    sub, rest = words[0], words[1:]
    flags = FLAG.findall(" ".join(words))
    where = f"`megatron-ba {sub}`"
    if _placeholder(sub):  # any subcommand: only what every parser accepts
        known, where = frozenset({"--help"}), "every subcommand"
    elif sub not in COMMANDS:
        return [f"{command!r}: unknown subcommand {sub!r} (megatron-ba has {sorted(COMMANDS)})"]
    elif sub == "perf" and rest and not rest[0].startswith("-"):
        from megatron_ba.commands.perf import PERF

        name, flags = rest[0], FLAG.findall(" ".join(rest[1:]))
        if _placeholder(name):
            known, where = frozenset({"--help"}), "every benchmark"
        elif name not in PERF:
            return [f"{command!r}: unknown measurement {name!r} (perf has {sorted(PERF)})"]
        else:
            known, where = benchmark_options(name), f"`megatron-ba perf {name}`"
    else:
        known = subcommand_options(sub)
    return [f"{command!r}: {f} is not an option of {where}" for f in flags if f not in known]


# --- links and anchors --------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: the text (link targets and markup dropped), lowercase,
    every character but letters, digits, `-`, `_` and spaces removed, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown page (repeats get -1, -2, ... as on GitHub)."""
    _, prose = split_markdown(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_anchor(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links of `text` (the page at `page`) to a missing file or heading."""
    _, prose = split_markdown(text)
    prose = INLINE_CODE.sub("", prose)  # `[x](y)` inside code is not a link
    problems = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve()
        if path and not dest.exists():
            problems.append(f"{_rel(page)}: [{target}] points to {path}, which does not exist")
            continue
        if not path:  # an anchor of this page
            dest, headings = page, anchors(text)
        else:
            headings = anchors(dest.read_text()) if dest.suffix == ".md" else None
        if anchor and headings is not None and anchor not in headings:
            problems.append(f"{_rel(page)}: [{target}]: {dest.name} has no heading #{anchor}")
    return problems


# --- scripts and test files named by the pages --------------------------------------------

SCRIPT = re.compile(
    r"\bbash\s+((?:scripts|slurm)/[\w.-]+\.sh)\b"
    r"|\bsbatch\b[^\n`|;]*?(?<![\w/.-])(slurm/[\w.-]+\.sh)\b"
)
TEST_FILE = re.compile(r"(?<![\w/.-])(tests/[\w/.-]+?\.py)\b")
# A path into the package, the benchmarks, the pins or the docs, as a page names it (`*`: a glob).
REPO_PATH = re.compile(
    r"(?<![\w/.<>-])((?:megatron_ba|benchmarks|requirements|docs)/[\w/.*-]*[\w*])(?![\w<>])"
)


def script_problems(text: str) -> list[str]:
    names = {a or b for a, b in SCRIPT.findall(text)}
    return [f"{name} does not exist" for name in sorted(names) if not (ROOT / name).is_file()]


def missing_test_files(text: str) -> list[str]:
    names = set(TEST_FILE.findall(text))
    return [f"{name} does not exist" for name in sorted(names) if not (ROOT / name).is_file()]


def missing_repo_paths(text: str) -> list[str]:
    """`megatron_ba/...`, `requirements/...`, `docs/...` paths (or globs) a page names that
    match nothing in the checkout."""
    names = set(REPO_PATH.findall(text))
    return [f"{name} does not exist" for name in sorted(names) if not any(ROOT.glob(name))]


ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def numbered_issue_references(text: str) -> list[str]:
    """The word issue(s) followed by a number (`#` optional): the project speaks of itself, not
    of a tracker's numbers."""
    return ISSUE_NUMBER.findall(text)


# --- the checks on the real pages ---------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_documented_commands_parse(page):
    commands = markdown_commands(page.read_text())
    assert [p for c in commands for p in command_problems(c)] == []


@pytest.mark.parametrize("recipe", RECIPES, ids=_rel)
def test_recipe_comment_commands_parse(recipe):
    text = recipe.read_text()
    assert [p for c in recipe_commands(text) for p in command_problems(c)] == []
    if recipe.name.startswith("qwen"):  # the planner call that sized it is among them
        assert any(c.startswith("megatron-ba layout --model") for c in recipe_commands(text))


def test_the_pages_hold_commands_of_every_kind():
    """The extraction finds what is there: code blocks, indented blocks, spans, recipes."""
    found = {c.split()[1] for p in PAGES for c in markdown_commands(p.read_text())}
    assert {"train", "layout", "convert", "check-layout", "compare", "eval", "perf"} <= found
    slurm = markdown_commands((ROOT / "slurm/README.md").read_text())
    assert slurm == [c for c in slurm if c.startswith("megatron-ba ")]
    parallelism = markdown_commands((ROOT / "docs/parallelism.md").read_text())
    assert any("--negative-control" in c for c in parallelism)  # an indented block in a list


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_anchors_resolve(page):
    assert link_problems(page, page.read_text()) == []


@pytest.mark.parametrize("page", [*PAGES, *RECIPES], ids=_rel)
def test_named_scripts_exist(page):
    assert script_problems(page.read_text()) == []


def test_named_test_files_exist():
    sources = [*PAGES, *RECIPES]
    for folder in ("megatron_ba", "scripts"):
        sources += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh"))
    problems = [f"{_rel(p)}: {x}" for p in sources for x in missing_test_files(p.read_text())]
    assert problems == []


def test_no_numbered_issue_references():
    folders = ("megatron_ba", "scripts", "tests", "slurm", "recipes", "docs")
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    files += [p for f in folders for p in sorted((ROOT / f).rglob("*")) if p.is_file()]
    suffixes = {".py", ".sh", ".md", ".yaml", ".toml", ".txt", ".json", ".jsonl"}
    found = {
        _rel(p): refs
        for p in files
        if p.suffix in suffixes and (refs := numbered_issue_references(p.read_text()))
    }
    assert found == {}


@pytest.mark.parametrize("page", [*PAGES, *RECIPES], ids=_rel)
def test_named_repository_paths_exist(page):
    assert missing_repo_paths(page.read_text()) == []


# --- negative controls: planted text each checker must reject -----------------------------

PLANTED_PAGE = """\
# A page

Prose with `megatron-ba layout --model qwen3-1.7b --gpu-memory 80` in it, and one over a line
break: `megatron-ba train RECIPE
--resume-from RUN_DIR`.

```bash
megatron-ba trian recipes/tiny-cpu.yaml      # then: megatron-ba convert A B --to-hf
megatron-ba check-layout --tp 2 \\
    --micro-batch 3
```

- an item:

      megatron-ba perf step --sequences 8 --no-such-flag
      megatron-ba perf nonesuch

| command | what |
|---|---|
| `megatron-ba convert HF_DIR OUT [--to megatron\\|hf] [--format x]` | ... |
| `megatron-ba train RECIPE` | a run (`--run-dir DIR`, `--verbos`); `backend=x --print-overrides` |
"""


def test_extraction_finds_every_form():
    assert markdown_commands(PLANTED_PAGE) == [
        "megatron-ba trian recipes/tiny-cpu.yaml",
        "megatron-ba convert A B --to-hf",
        "megatron-ba check-layout --tp 2 --micro-batch 3",
        "megatron-ba perf step --sequences 8 --no-such-flag",
        "megatron-ba perf nonesuch",
        "megatron-ba layout --model qwen3-1.7b --gpu-memory 80",
        "megatron-ba train RECIPE --resume-from RUN_DIR",
        "megatron-ba convert HF_DIR OUT [--to megatron/hf] [--format x]",
        "megatron-ba train RECIPE",
        "megatron-ba train --run-dir DIR",
        "megatron-ba train --verbos",
    ]
    # not a command: a path, a file name, an extra, the bare name
    assert commands_in("~/.cache/megatron-ba/envs megatron-ba.sqsh megatron-ba[trl]") == []
    assert inline_code_spans("the `megatron-ba` command") == ["megatron-ba"]
    assert commands_in("megatron-ba") == []
    assert commands_in(
        "torchrun --nproc-per-node 2 -m megatron_ba.cli train r.yaml --rundir x"
    ) == ["megatron-ba train r.yaml --rundir x"]


def test_planted_unknown_flags_and_subcommands_are_caught():
    problems = [p for c in markdown_commands(PLANTED_PAGE) for p in command_problems(c)]
    for needle in (
        "unknown subcommand 'trian'",
        "--to-hf is not an option of `megatron-ba convert`",
        "--micro-batch is not an option of `megatron-ba check-layout`",  # an abbreviation
        "--no-such-flag is not an option of `megatron-ba perf step`",
        "unknown measurement 'nonesuch'",
        "--gpu-memory is not an option of `megatron-ba layout`",
        "--resume-from is not an option of `megatron-ba train`",
        "--format is not an option of `megatron-ba convert`",
        "--verbos is not an option of `megatron-ba train`",  # a table row's flag
    ):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    assert len(problems) == 9, problems
    # ... while the same lines spelled right pass
    for good in (
        "megatron-ba convert A B --to hf",
        "megatron-ba check-layout --tp 2 --micro-batches 3",
        "megatron-ba perf step --sequences 8 --json out.json",
        "megatron-ba layout --model qwen3-1.7b --gpu-mem 80",
        "megatron-ba train RECIPE --resume RUN_DIR",
        "megatron-ba COMMAND --help",
        "megatron-ba --help",
    ):
        assert command_problems(good) == [], good
    assert command_problems("megatron-ba COMMAND --json") != []
    # a flag the parser takes but --help hides (the benchmark's internal worker switch)
    assert command_problems("megatron-ba perf vocab-parallel --worker memory") == [
        "'megatron-ba perf vocab-parallel --worker memory': --worker is not an option of "
        "`megatron-ba perf vocab-parallel`"
    ]


def test_planted_recipe_comment_is_caught():
    text = (ROOT / "recipes/qwen3-1.7b-dapo17k.yaml").read_text()
    assert [p for c in recipe_commands(text) for p in command_problems(c)] == []
    bad = text.replace("--gpus-per-node 8", "--gpus-per-nodes 8", 1)
    assert bad != text
    problems = [p for c in recipe_commands(bad) for p in command_problems(c)]
    assert len(problems) == 1 and "--gpus-per-nodes" in problems[0], problems
    assert recipe_commands("model:\n  precision: bf16  # megatron-ba layout --tpp 2\n") == [
        "megatron-ba layout --tpp 2"
    ]


def test_github_anchors_by_hand():
    assert (
        github_anchor("The GPU check (scripts/gpu_check.sh)") == "the-gpu-check-scriptsgpu_checksh"
    )
    assert github_anchor("3. The scaling factors") == "3-the-scaling-factors"
    assert github_anchor("`megatron-ba layout`") == "megatron-ba-layout"
    assert github_anchor("`model`: a Hugging Face checkpoint") == "model-a-hugging-face-checkpoint"
    assert github_anchor("See [status](status.md) here") == "see-status-here"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B c\n") == {"a", "a-1", "b-c"}


def test_planted_broken_links_and_anchors_are_caught():
    page = ROOT / "docs/planted.md"  # as if it lived in docs/ (never written)
    good = (
        "[s](status.md) [p](performance.md#the-gpu-check-scriptsgpu_checksh) "
        "[r](../slurm/README.md#the-gpu-environment) [x](https://example.org/nope.md) "
        "[here](#a-heading) `[not](a-link.md)`\n\n## A heading\n"
    )
    assert link_problems(page, good) == []
    for bad, why in (
        ("[s](statuss.md)", "statuss.md, which does not exist"),
        ("[p](performance.md#the-gpu-check)", "performance.md has no heading #the-gpu-check"),
        ("[r](../slurm/README.md#gpu-environment)", "README.md has no heading #gpu-environment"),
        ("[here](#no-such-heading)", "planted.md has no heading #no-such-heading"),
        ("[t](../tests/test_nope.py)", "../tests/test_nope.py, which does not exist"),
    ):
        problems = link_problems(page, good + bad)
        assert len(problems) == 1 and why in problems[0], (bad, problems)


def test_planted_missing_files_and_issue_numbers_are_caught():
    assert script_problems("bash scripts/run_tests.sh; sbatch slurm/grpo_balanced.sh R") == []
    text = (
        "bash scripts/run_test.sh\n"
        "sbatch --nodes=2 --time=1:00:00 slurm/grpo_balance.sh recipes/x.yaml\n"
        "`bash slurm/interactiv.sh RECIPE`\n"
    )
    assert script_problems(text) == [
        "scripts/run_test.sh does not exist",
        "slurm/grpo_balance.sh does not exist",
        "slurm/interactiv.sh does not exist",
    ]
    assert missing_test_files("tests/test_recipe.py and tests/nemo/test_nemo_actor.py") == []
    assert missing_test_files("(tests/test_devices_te_names.py checks it)") == [
        "tests/test_devices_te_names.py does not exist"
    ]
    assert (
        missing_repo_paths("`megatron_ba/train/` `megatron_ba/megatron/*.py` docs/status.md.") == []
    )
    assert missing_repo_paths(
        "megatron_ba/megatron/mcore_optimiser.py, requirements/gpu-*.txt"
    ) == [
        "megatron_ba/megatron/mcore_optimiser.py does not exist",
        "requirements/gpu-*.txt does not exist",
    ]
    assert numbered_issue_references("every collective megatron-ba issues; issue tracker") == []
    planted = "(no sync folder since issue" + " 10); Issue" + " 8, item 2; see issues" + " #3"
    assert len(numbered_issue_references(planted)) == 3
