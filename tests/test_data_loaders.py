"""Loaders read their fixtures in the real schemas and reject broken ones naming the column."""

import base64
import json
import pickle
import zlib

import pytest
from data_helpers import BENCH, FIXTURES, read_jsonl, without_column, write_jsonl

from megatron_ba.data import (
    SchemaError,
    decode_test_cases,
    find_local_source,
    load_benchmark,
    load_dapo_math,
    load_livecodebench,
    load_polaris,
    parse_difficulty,
    render_prompt,
)
from megatron_ba.data.livecodebench import version_files

DAPO = FIXTURES / "dapo_math.jsonl"
POLARIS = FIXTURES / "polaris.jsonl"


def test_dapo_dedupes_and_round_trips_the_template(tmp_path):
    loaded = load_dapo_math(DAPO)
    rows = read_jsonl(DAPO)
    assert loaded.report.rows_read == len(rows) == 15
    assert len(loaded) == loaded.report.kept == 3
    assert loaded.report.dropped == {
        "duplicate prompt": 8,
        "prompt with conflicting ground truths": 4,  # a4: three copies say 2, one says 3
    }
    assert [p.answer for p in loaded] == ["23", "7", "9"]
    assert [p.id for p in loaded] == ["a1", "a2", "a3"]
    assert loaded[0].question == "What is $3 + 4 \\cdot 5$?"
    # rendering the bare question with the "dapo" template gives the data set's prompt back
    assert render_prompt(loaded[1].question, "dapo") == rows[1]["prompt"][0]["content"]
    assert len(load_dapo_math(DAPO, dedupe=False)) == 11


def test_dapo_counts_conflicting_ground_truths_apart_from_duplicates(tmp_path, caplog):
    """A prompt seen with different ground truths is reported, and dropped
    unless on_conflict="keep_first" keeps the first row's truth."""
    dropped = load_dapo_math(DAPO)
    assert dropped.report.conflicts == 1
    assert "1 prompts appear with different ground truths: dropped" in dropped.report.summary()
    assert "on_conflict='drop'" in caplog.text
    first = load_dapo_math(DAPO, on_conflict="keep_first")
    assert [(p.id, p.answer) for p in first] == [
        ("a1", "23"),
        ("a2", "7"),
        ("a3", "9"),
        ("a4", "2"),
    ]
    assert first.report.conflicts == 1
    assert first.report.dropped == {
        "duplicate prompt": 10,
        "conflicting ground truth (not the first)": 1,
    }
    assert "kept with their first ground truth" in first.report.summary()
    raw = load_dapo_math(DAPO, dedupe=False, on_conflict="keep_first")
    assert len(raw) == 14 and "3" not in {p.answer for p in raw if p.id == "a4"}
    # the control: the same file without the mislabelled copy has no conflict and no note
    rows = [r for r in read_jsonl(DAPO) if r["reward_model"]["ground_truth"] != "3"]
    clean = load_dapo_math(write_jsonl(tmp_path / "clean.jsonl", rows))
    assert clean.report.conflicts == 0 and clean.report.notes == [] and len(clean) == 4
    with pytest.raises(ValueError, match="on_conflict must be one of"):
        load_dapo_math(DAPO, on_conflict="keep_last")


def test_dapo_reads_parquet_like_the_hub_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(read_jsonl(DAPO)), path)
    loaded = load_dapo_math(path)
    assert [p.answer for p in loaded] == ["23", "7", "9"]
    assert loaded.report.dropped == {
        "duplicate prompt": 8,
        "prompt with conflicting ground truths": 4,
    }


def test_dapo_rejects_a_missing_ground_truth(tmp_path):
    rows = read_jsonl(DAPO)
    for r in rows:
        r["reward_model"] = {"style": "rule"}
    with pytest.raises(SchemaError, match=r"missing column 'reward_model\.ground_truth'"):
        load_dapo_math(write_jsonl(tmp_path / "broken.jsonl", rows))
    with pytest.raises(SchemaError, match="missing column 'prompt'"):
        load_dapo_math(without_column(DAPO, tmp_path / "noprompt.jsonl", "prompt"))


def test_polaris_filters_by_pass_rate(tmp_path):
    full = load_polaris(POLARIS)
    assert len(full) == 5 and full.report.dropped == {}
    assert [p.meta["pass_rate"] for p in full] == [1.0, 5 / 8, 7 / 8, 0.0, 3 / 8]
    solved_dropped = load_polaris(POLARIS, drop_solved=True)
    assert [p.answer for p in solved_dropped] == ["\\frac{5}{6}", "4", "101", "7"]
    assert solved_dropped.report.dropped == {"solved by the reference model": 1}
    mid = load_polaris(POLARIS, pass_rate_range=(0.1, 0.9))
    assert [p.answer for p in mid] == ["\\frac{5}{6}", "4", "7"]
    with pytest.raises(ValueError, match="pass_rate_range"):
        load_polaris(POLARIS, pass_rate_range=(0.9, 0.1))


def test_polaris_rejects_broken_files(tmp_path):
    with pytest.raises(SchemaError, match="missing column 'difficulty'"):
        load_polaris(without_column(POLARIS, tmp_path / "b.jsonl", "difficulty"))
    rows = read_jsonl(POLARIS)
    rows[2]["difficulty"] = "easy"
    with pytest.raises(SchemaError, match=r"row 2: difficulty must look like 'k/n'"):
        load_polaris(write_jsonl(tmp_path / "c.jsonl", rows))
    assert parse_difficulty("3/8") == 0.375
    for bad in ("9/8", "1/0", "x"):
        with pytest.raises(ValueError):
            parse_difficulty(bad)


EXPECTED_ANSWERS = {
    "math500": ["\\frac{3}{4}", "3", "[1,\\infty)"],
    "aime24": ["24", "14"],
    "aime25": ["28", "51"],
    "olympiad": ["2, -2", "\\frac{3}{4}"],  # final_answer lists joined, $...$ removed
    "minerva": ["60", "2"],
}
QUESTION_COLUMN = {
    "math500": "problem",
    "aime24": "problem",
    "aime25": "problem",
    "olympiad": "question",
    "minerva": "question",
}
ANSWER_COLUMN = {
    "math500": "answer",
    "aime24": "answer",
    "aime25": "answer",
    "olympiad": "final_answer",
    "minerva": "answer",
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ANSWERS))
def test_math_benchmarks_read_and_reject(name, tmp_path):
    src = find_local_source(BENCH, name)
    loaded = load_benchmark(name, src)
    assert [p.answer for p in loaded] == EXPECTED_ANSWERS[name]
    assert all(p.kind == "math" and p.question for p in loaded)
    with pytest.raises(SchemaError, match="missing question column"):
        load_benchmark(name, without_column(src, tmp_path / "q.jsonl", QUESTION_COLUMN[name]))
    no_answer = without_column(src, tmp_path / "a.jsonl", ANSWER_COLUMN[name])
    no_answer = without_column(no_answer, tmp_path / "a2.jsonl", "solution")
    with pytest.raises(SchemaError, match="missing answer column"):
        load_benchmark(name, no_answer)


def test_answer_from_the_solution_box_when_no_answer_column(tmp_path):
    """Minerva copies without an answer column: the last \\boxed{} of `solution` is the answer;
    a file where no row has one is rejected rather than silently emptied."""
    src = without_column(BENCH / "math500.jsonl", tmp_path / "m.jsonl", "answer")
    assert [p.answer for p in load_benchmark("minerva", src)] == [
        "\\frac{3}{4}",
        "3",
        "[1, \\infty)",
    ]
    no_box = without_column(BENCH / "aime24.jsonl", tmp_path / "a.jsonl", "answer")
    with pytest.raises(SchemaError, match="no usable rows"):
        load_benchmark("aime24", no_box)


def test_unknown_benchmark_and_bad_source(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("gsm8k")
    with pytest.raises(ValueError, match="neither an existing path nor a hub id"):
        load_benchmark("math500", "no_such_file.jsonl")
    with pytest.raises(ValueError, match=r"no \.parquet/\.jsonl/\.json"):
        load_benchmark("math500", tmp_path)


def test_livecodebench_decodes_tests_and_filters_dates():
    lcb = load_livecodebench(BENCH / "livecodebench")
    assert len(lcb) == 3
    add, double, _ = lcb.problems
    assert add.kind == "code" and add.func_name is None and add.starter_code == ""
    assert [t["input"] for t in add.tests] == ["1 2\n", "10 20\n", "-5 5\n"]  # 1 public + 2 priv
    assert double.func_name == "doubleAll" and double.starter_code.startswith("class Solution")
    assert [t["testtype"] for t in double.tests] == ["functional", "functional"]
    recent = load_livecodebench(BENCH / "livecodebench", since="2024-01-01", until="2024-09-30")
    assert [p.id for p in recent] == ["abc000_a"]
    assert recent.report.dropped == {"contest date out of range": 2}
    assert version_files("release_v3") == ["test.jsonl", "test2.jsonl", "test3.jsonl"]
    with pytest.raises(ValueError, match="release_v5"):
        version_files("v5")


def test_livecodebench_rejects_a_missing_column(tmp_path):
    src = BENCH / "livecodebench" / "test.jsonl"
    broken = without_column(src, tmp_path / "test.jsonl", "private_test_cases")
    with pytest.raises(SchemaError, match="missing column 'private_test_cases'"):
        load_livecodebench(broken)


def _ids_and_tests(loaded):
    return [(p.id, p.tests, p.func_name, p.meta["contest_date"]) for p in loaded]


def test_livecodebench_reads_one_json_array_of_the_same_records(tmp_path):
    """Public evaluation repos save LiveCodeBench as one JSON array: it is read too."""
    src = BENCH / "livecodebench" / "test.jsonl"
    rows = read_jsonl(src)
    expected = _ids_and_tests(load_livecodebench(src))
    pretty = tmp_path / "lcb.json"
    pretty.write_text(json.dumps(rows, indent=2))
    assert _ids_and_tests(load_livecodebench(pretty)) == expected
    one_line = tmp_path / "test.jsonl"  # an array under the JSONL name, on one line
    one_line.write_text(json.dumps(rows))
    assert _ids_and_tests(load_livecodebench(one_line)) == expected
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "livecodebench.json").write_text("\n  " + json.dumps(rows, indent=1))
    assert _ids_and_tests(load_livecodebench(folder)) == expected


def test_livecodebench_says_what_it_expects(tmp_path):
    rows = read_jsonl(BENCH / "livecodebench" / "test.jsonl")
    expected = r"expected JSON Lines .* or one JSON array .* question_content, public_test_cases"
    truncated = tmp_path / "cut.json"
    truncated.write_text(json.dumps(rows, indent=2)[:-40])
    with pytest.raises(SchemaError, match=rf"starts like a JSON array(.|\n)*{expected}"):
        load_livecodebench(truncated)
    garbage = tmp_path / "g.jsonl"
    garbage.write_text(json.dumps(rows[0]) + "\nquestion_id,question_content\n")
    with pytest.raises(SchemaError, match=rf"g.jsonl:2: not a JSON object .*{expected}"):
        load_livecodebench(garbage)
    renamed = [{"title": r["question_title"], "tests": r["public_test_cases"]} for r in rows]
    other = write_jsonl(tmp_path / "other.jsonl", renamed)
    msg = (
        r"other.jsonl:1: missing column 'question_content' \(missing \['question_content', "
        r"'public_test_cases', 'private_test_cases', 'question_id'\]; the record has "
        r"\['tests', 'title'\]\)"
    )
    with pytest.raises(SchemaError, match=msg):
        load_livecodebench(other)
    not_objects = tmp_path / "ids.json"
    not_objects.write_text(json.dumps(["abc000_a", "9001"]))
    with pytest.raises(SchemaError, match=r"ids.json: record 0: a str, not an object"):
        load_livecodebench(not_objects)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/mba_unpickle_marker",))


def test_private_tests_never_unpickle_objects():
    cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()
    assert decode_test_cases(packed) == cases
    assert decode_test_cases(json.dumps(cases)) == cases
    evil = base64.b64encode(zlib.compress(pickle.dumps(_Evil()))).decode()
    with pytest.raises(ValueError, match="refusing to load global"):
        decode_test_cases(evil)
    import os

    assert not os.path.exists("/tmp/mba_unpickle_marker")
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_test_cases("not base64 or json!")


def test_a_hub_id_without_network_names_the_source_and_the_remedy():
    from megatron_ba.data import load_dapo_math

    with pytest.raises(ConnectionError, match=r"^source 'org/absent-set': not a local path, and"):
        load_dapo_math("org/absent-set")  # data_helpers set HF_HUB_OFFLINE: nothing is fetched
