"""SFT rows (S1): the shapes people have (prompt/completion, TRL's messages and conversational prompt-completion,
GSM8K), files or datasets, bad rows named by file and line, and the split by prompt."""

from __future__ import annotations

import json

import pytest

from tether.errors import DataError
from tether.sft.data import SFTRow, load_rows, row_from_record, rows_from_data


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_every_shape_becomes_prompt_completion_with_its_columns():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A2"}]
    conv = row_from_record({"messages": msgs, "id": 3}, "w")
    assert (conv.prompt, conv.completion, conv.all_turns, conv.columns) == (msgs[:-1], "A2", True, {"id": 3})
    assert row_from_record({"prompt": "P", "completion": "C", "answer": "7"}, "w") == \
        SFTRow("P", "C", False, {"completion": "C", "answer": "7"}, "w")
    trl = row_from_record({"prompt": [{"role": "user", "content": "P"}],
                           "completion": [{"role": "assistant", "content": "C"}]}, "w")
    assert (trl.prompt, trl.completion, trl.all_turns) == ([{"role": "user", "content": "P"}], "C", False)
    assert row_from_record({"prompt": "P", "response": "R"}, "w").completion == "R"
    gsm = row_from_record({"question": "Q?", "answer": "work\n#### 42"}, "w")
    assert (gsm.prompt, gsm.completion, gsm.columns) == ("Q?", "work\n#### 42", {"answer": "work\n#### 42"})
    assert row_from_record({"prompt": "12+34=", "answer": "64"}, "w").completion == "64"  # the demo's rows


@pytest.mark.parametrize("record, message", [
    ({"prompt": "P"}, "expected 'messages', 'prompt' + 'completion'"),
    ({"prompt": "P", "completion": "  "}, "field 'completion' is empty"),
    ({"prompt": "", "completion": "C"}, "field 'prompt' is empty"),
    ({"prompt": 3, "completion": "C"}, "field 'prompt' must be text, got int"),
    ({"prompt": "P", "completion": [{"role": "user", "content": "C"}]}, "field 'completion' must be one assistant"),
    ({"messages": [{"role": "user", "content": "U"}]}, "the last message must be the assistant's"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]},
     "the last assistant reply must answer a user turn"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "robot", "content": "A"}]}, "role 'robot'"),
    ({"prompt": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], "completion": "C"},
     "the last message must be the user's"),
])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "ok", "completion": "fine"}, record])
    with pytest.raises(DataError) as e:
        load_rows([str(path)])
    assert str(e.value).startswith(f"{path}: line 2: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_unreadable_lines_and_skip_invalid_counts(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}, "{not json", {"prompt": "c"},
                                                {"prompt": "d", "completion": "e"}])
    with pytest.raises(DataError, match=r"sft.jsonl: line 2: invalid JSON"):
        load_rows([str(path)])
    rows, stats = load_rows([str(path)], skip_invalid=True)
    assert [r.prompt for r in rows] == ["a", "d"] and [r.source for r in rows] == [f"{path}: line 1", f"{path}: line 4"]
    assert (stats.rows, stats.kept, stats.invalid) == (4, 2, 2) and "line 2" in stats.summary()


def test_csv_rows_and_rows_from_python_are_named_too(tmp_path):
    csv = tmp_path / "sft.csv"
    csv.write_text("prompt,completion\nP1,C1\nP2,\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"sft.csv: line 3: field 'completion' is empty"):
        load_rows([str(csv)])
    with pytest.raises(DataError, match=r"^train_data: row 2: expected 'messages'"):
        rows_from_data([{"prompt": "a", "completion": "b"}, {"body": "c"}], "train_data")  # ({"text"} is a shape)
    datasets = pytest.importorskip("datasets")
    rows, _ = rows_from_data(datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}]), "train_data")
    assert rows[0].prompt == "a" and rows[0].source == "train_data: row 1"


def test_split_by_prompt_keeps_each_prompt_on_one_side():
    from tether.inputs.splits import split_by_prompt

    rows = [SFTRow(f"p{i % 10}", f"c{i}") for i in range(40)]  # 10 prompts, 4 completions each (RFT-like)
    train, held = split_by_prompt(rows, 0.2, seed=0)
    assert len(held) == 8 and not {r.prompt for r in train} & {r.prompt for r in held}
    reversed_held = split_by_prompt(rows[::-1], 0.2, seed=0)[1]  # the same rows held out, whatever the file order
    assert {r.completion for r in reversed_held} == {r.completion for r in held}
