"""HLE and FRAMES files (JSONL, JSON, parquet written here with pyarrow) become tasks; bad rows
are errors naming their row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_orch.data.conversations import DataError
from nemo_orch.data.records import read_records
from nemo_orch.envs.qa.readers import (
    MULTIPLE_CHOICE_INSTRUCTION,
    SYSTEM_PROMPT,
    read_frames,
    read_hle,
)

HLE_ROWS = [
    {
        "id": "6687ffb1091058ff19128813",
        "question": "What is the 3rd prime?",
        "answer": "5",
        "answer_type": "exactMatch",
        "image": "",
        "category": "Math",
        "raw_subject": "Math",
        "rationale": "2, 3, 5",
        "author_name": "A",
        "canary": "CANARY",
    },
    {
        "id": "668825f80a642802bdfeadfa",
        "question": "Which is a color?\nA. Dog\nB. Red",
        "answer": "B",
        "answer_type": "multipleChoice",
        "image": "",
        "category": "Other",
    },
    {
        "id": "66ba5510db07a3a9151be0d2",
        "question": "What is in the picture?",
        "answer": "a cat",
        "answer_type": "exactMatch",
        "image": "data:image/png;base64,iVBORw0KGgo=",
        "category": "Other",
    },
    {
        "id": "66e8ccd402beabf885334534",
        "question": "Name the author.",
        "answer": "Vel Anor",
        "answer_type": "exactMatch",
        "image": "",
        "category": "Humanities",
    },
]
FRAMES_ROWS = [
    {
        "Unnamed: 0": 0,
        "Prompt": "Who wrote the novel set in Ostrel?",
        "Answer": "Vel Anor",
        "wiki_links": "['https://en.wikipedia.org/wiki/Ostrel', "
        "'https://en.wikipedia.org/wiki/Vel_Anor']",
        "reasoning_types": "Multiple constraints | Temporal reasoning",
    },
    {
        "Unnamed: 0": 1,
        "Prompt": "How high is Mount Kelu?",
        "Answer": "4200 m",
        "wiki_links": "['https://en.wikipedia.org/wiki/Mount_Kelu']",
        "reasoning_types": "Numerical reasoning",
    },
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_hle_jsonl_and_parquet_read_identically(tmp_path):
    from_jsonl = read_hle(write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS))
    from_parquet = read_hle(write_parquet(tmp_path / "hle.parquet", HLE_ROWS))
    assert from_jsonl == from_parquet
    assert from_jsonl.name == "hle"
    assert [task.id for task in from_jsonl.tasks] == [
        "6687ffb1091058ff19128813",
        "668825f80a642802bdfeadfa",
        "66e8ccd402beabf885334534",
    ]
    assert from_jsonl.skipped == {"image": 1}  # text-only orchestrators: the image row is out
    first = from_jsonl.tasks[0]
    assert (first.question, first.answer, first.system) == (
        "What is the 3rd prime?",
        "5",
        SYSTEM_PROMPT,
    )
    assert "<answer></answer>" in first.system
    assert first.metadata == {"benchmark": "hle", "answer_type": "exactMatch", "category": "Math"}
    assert first.allowed_documents is None and first.tools is None


def test_hle_multiple_choice_asks_for_the_letter_and_null_images_are_text_only(tmp_path):
    rows = [dict(HLE_ROWS[1], image=None), {"id": 7, "question": "2+2?", "answer": 4}]
    tasks = read_hle(write_jsonl(tmp_path / "hle.jsonl", rows)).tasks
    assert tasks[0].question == (
        "Which is a color?\nA. Dog\nB. Red\n\n" + MULTIPLE_CHOICE_INSTRUCTION
    )
    assert "letter" in MULTIPLE_CHOICE_INSTRUCTION
    # Canonical minimal rows: no answer type (exact match), no category.
    assert (tasks[1].id, tasks[1].question, tasks[1].answer) == ("7", "2+2?", "4")
    assert tasks[1].metadata == {"benchmark": "hle"}


def test_limit_counts_tasks_and_the_skips_before_them(tmp_path):
    path = write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS)
    two = read_hle(path, limit=2)
    assert [t.id for t in two.tasks] == [row["id"] for row in HLE_ROWS[:2]]
    assert two.skipped == {}
    three = read_hle(path, limit=3)
    assert three.tasks[-1].id == HLE_ROWS[3]["id"] and three.skipped == {"image": 1}
    assert len(read_frames(write_jsonl(tmp_path / "f.jsonl", FRAMES_ROWS), limit=1).tasks) == 1
    with pytest.raises(ValueError, match="limit must be None or >= 1"):
        read_hle(path, limit=0)


@pytest.mark.parametrize("field", ["id", "question", "answer"])
def test_hle_missing_or_empty_field_names_line_and_field(tmp_path, field):
    missing = {k: v for k, v in HLE_ROWS[0].items() if k != field}
    path = write_jsonl(tmp_path / "hle.jsonl", [HLE_ROWS[1], missing])
    with pytest.raises(DataError, match=rf"hle.jsonl:2: {field} must be a non-empty"):
        read_hle(path)
    empty = write_parquet(tmp_path / "hle.parquet", [HLE_ROWS[1], dict(HLE_ROWS[0], **{field: ""})])
    with pytest.raises(DataError, match=rf"hle.parquet\[row 1\]: {field} must be a non-empty"):
        read_hle(empty)


def test_bad_files_are_errors_naming_the_row(tmp_path):
    bad_json = tmp_path / "hle.jsonl"
    bad_json.write_text(json.dumps(HLE_ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(DataError, match=r"hle.jsonl:3: not valid JSON"):
        read_hle(bad_json)
    with pytest.raises(
        DataError,
        match=r"hle.jsonl:2: duplicate task id '6687ffb1091058ff19128813'"
        r" \(first at .*hle.jsonl:1\)",
    ):
        read_hle(write_jsonl(tmp_path / "hle.jsonl", [HLE_ROWS[0], HLE_ROWS[0]]))
    with pytest.raises(DataError, match=r"hle.jsonl:1: answer_type must be one of"):
        read_hle(write_jsonl(tmp_path / "hle.jsonl", [dict(HLE_ROWS[0], answer_type="essay")]))
    with pytest.raises(DataError, match=r"hle.csv: unknown benchmark file type '.csv'"):
        read_hle(tmp_path / "hle.csv")
    with pytest.raises(DataError, match=r"rows.jsonl:2: a benchmark row must be a JSON object"):
        read_records(write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}, [1, 2]]))
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"a": 1}, "text"]))
    with pytest.raises(DataError, match=r"rows.json\[row 1\]: a benchmark row must be a JSON"):
        read_records(array)
    array.write_text('[{"a": 1},\n {"a": ]')
    with pytest.raises(DataError, match=r"rows.json:2: not valid JSON"):
        read_records(array)
    array.write_text('{"a": 1}')
    with pytest.raises(DataError, match=r"rows.json: a .json benchmark file must hold an array"):
        read_records(array)
    array.write_text("[]")
    with pytest.raises(DataError, match=r"rows.json: no benchmark rows"):
        read_records(array)
    not_parquet = tmp_path / "rows.parquet"
    not_parquet.write_text("id,question\n")
    with pytest.raises(DataError, match=r"rows.parquet: cannot read the parquet file"):
        read_records(not_parquet)
    with pytest.raises(DataError, match=r"absent.parquet: cannot read the parquet file"):
        read_records(tmp_path / "absent.parquet")


def test_read_records_locates_rows_in_every_format(tmp_path):
    rows = [{"a": 1}, {"a": 2}]
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows))
    assert [where for where, _ in read_records(write_jsonl(tmp_path / "rows.jsonl", rows))] == [
        f"{tmp_path}/rows.jsonl:1",
        f"{tmp_path}/rows.jsonl:2",
    ]
    assert read_records(array) == [(f"{array}[row 0]", rows[0]), (f"{array}[row 1]", rows[1])]
    parquet = write_parquet(tmp_path / "rows.parquet", [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    assert read_records(parquet, columns=["a", "missing"]) == [
        (f"{parquet}[row 0]", rows[0]),
        (f"{parquet}[row 1]", rows[1]),
    ]


def test_frames_links_are_read_as_each_questions_own_documents(tmp_path):
    as_lists = [
        dict(row, wiki_links=json.loads(row["wiki_links"].replace("'", '"'))) for row in FRAMES_ROWS
    ]
    literal = read_frames(write_jsonl(tmp_path / "frames.jsonl", FRAMES_ROWS))
    listed = read_frames(write_parquet(tmp_path / "frames.parquet", as_lists))
    assert literal == listed
    assert literal.name == "frames" and literal.skipped == {}
    first = literal.tasks[0]
    assert first.id == "frames-0" and first.answer == "Vel Anor" and first.system == SYSTEM_PROMPT
    assert first.allowed_documents == {
        "https://en.wikipedia.org/wiki/Ostrel",
        "https://en.wikipedia.org/wiki/Vel_Anor",
    }
    assert first.metadata == {
        "benchmark": "frames",
        "reasoning_types": ["Multiple constraints", "Temporal reasoning"],
    }


def test_frames_ids_fall_back_to_id_then_row_index(tmp_path):
    links = ["https://en.wikipedia.org/wiki/A"]
    by_id = [{"id": "q7", "question": "Q?", "answer": "A", "wiki_links": links}]
    assert read_frames(write_jsonl(tmp_path / "a.jsonl", by_id)).tasks[0].id == "frames-q7"
    no_id = [
        {"Prompt": "Q1?", "Answer": "A", "wiki_links": links},
        {"question": "Q2?", "answer": 3, "wiki_links": links},
    ]
    array = tmp_path / "b.json"
    array.write_text(json.dumps(no_id))
    tasks = read_frames(array).tasks
    assert [(t.id, t.question, t.answer) for t in tasks] == [
        ("frames-0", "Q1?", "A"),
        ("frames-1", "Q2?", "3"),
    ]
    assert tasks[1].metadata == {"benchmark": "frames"}  # no reasoning types given
    # Without wiki_links nothing restricts retrieval.
    bare = [{"id": 1, "question": "Q?", "answer": "A"}]
    assert read_frames(write_jsonl(tmp_path / "c.jsonl", bare)).tasks[0].allowed_documents is None


def test_frames_bad_rows(tmp_path):
    base = dict(FRAMES_ROWS[0])
    with pytest.raises(DataError, match=r"f.jsonl:1: wiki_links is not a list literal"):
        read_frames(
            write_jsonl(tmp_path / "f.jsonl", [dict(base, wiki_links="[__import__('os')]")])
        )
    with pytest.raises(DataError, match=r"f.jsonl:1: wiki_links must be a non-empty list"):
        read_frames(write_jsonl(tmp_path / "f.jsonl", [dict(base, wiki_links="[]")]))
    with pytest.raises(DataError, match=r"f.jsonl:1: wiki_links must be a non-empty list"):
        read_frames(write_jsonl(tmp_path / "f.jsonl", [dict(base, wiki_links="{'a': 1}")]))
    with pytest.raises(DataError, match=r"f.jsonl:2: duplicate task id 'frames-0'"):
        read_frames(write_jsonl(tmp_path / "f.jsonl", [base, base]))
    with pytest.raises(DataError, match=r"f.jsonl:1: Prompt or question must be a non-empty"):
        read_frames(write_jsonl(tmp_path / "f.jsonl", [dict(base, Prompt=" ")]))
    with pytest.raises(DataError, match=r"f.jsonl:1: reasoning_types must be a string"):
        read_frames(write_jsonl(tmp_path / "f.jsonl", [dict(base, reasoning_types=["a"])]))
