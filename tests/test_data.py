"""tether.inputs (records and pairs): record reading (every format, every bad input named by file and line/row) and
preference pairs (both shapes, skip counts, the split by prompt, length balancing, real HH-RLHF)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from tether.errors import DataError
from tether.inputs.conversations import split_transcript, transcript_messages
from tether.inputs.pairs import PreferencePair, balance_by_length, balance_by_reply, load_preference_pairs, split_pairs
from tether.inputs.records import read_records, record_location

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}]


# ------------------------------------------------------------------------------------------------ records
def test_jsonl_records_carry_line_numbers_and_skip_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [ROWS[0], "", ROWS[1]])
    assert read_records(path) == [(1, ROWS[0]), (3, ROWS[1])]
    assert record_location(path, 3) == f"{path}: line 3"


def test_gzip_jsonl_and_json_array_and_csv_and_parquet_and_dataset_read_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    array = tmp_path / "a.json"
    array.write_text(json.dumps(ROWS, indent=1), encoding="utf-8")
    csv_path = tmp_path / "a.csv"
    csv_path.write_text("prompt,chosen,rejected\n2+2=,4,5\n1+1=,2,3\n", encoding="utf-8")
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    for path in (gz, array, csv_path, parquet, folder):
        assert [r for _, r in read_records(path)] == ROWS, path
    assert [n for n, _ in read_records(csv_path)] == [2, 3]  # CSV: the line of each row (header is line 1)
    assert [n for n, _ in read_records(parquet)] == [1, 2]
    assert record_location(parquet, 2) == f"{parquet}: row 2"


def test_csv_row_spanning_lines_is_numbered_by_its_first_line(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('prompt,chosen,rejected\n"a\nb",x,y\nc,d,e\n', encoding="utf-8")
    assert [(n, r["prompt"]) for n, r in read_records(path)] == [(2, "a\nb"), (4, "c")]


@pytest.mark.parametrize("content, expected", [
    (b'{"a": 1}\n{"a": \n', "line 2: invalid JSON"),
    (b'{"a": 1}\n[1, 2]\n', "line 2: expected a JSON object"),
    (b'{"a": 1}\n{"a": "\xff"}\n', "line 2: not UTF-8 text (byte 0xff)"),
])
def test_bad_jsonl_line_is_named(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        read_records(path)
    assert str(e.value) == f"{path}: {expected}" or str(e.value).startswith(f"{path}: {expected}")
    assert "\n" not in str(e.value)
    skipped: list[str] = []
    assert read_records(path, skip_invalid=True, skipped=skipped) == [(1, {"a": 1})]
    assert len(skipped) == 1 and expected in skipped[0]


def test_bad_csv_rows_are_named_and_skippable(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"prompt,chosen,rejected\np,c,r\np,c\np,\xfe,r\n")
    with pytest.raises(DataError, match=r"bad\.csv: line 3: expected 3 fields, got 2"):
        read_records(path)
    skipped: list[str] = []
    kept = read_records(path, skip_invalid=True, skipped=skipped)
    assert kept == [(2, {"prompt": "p", "chosen": "c", "rejected": "r"})]
    assert [s.split(": ", 1)[1] for s in skipped] == ["line 3: expected 3 fields, got 2",
                                                    "line 4: not UTF-8 text (byte 0xfe)"]
    path.write_bytes(b"prompt,chosen,rejected\np,c,r\np,\xfe,r\n")
    with pytest.raises(DataError, match=r"bad\.csv: line 3: not UTF-8 text \(byte 0xfe\)"):
        read_records(path)


def test_missing_file_unknown_extension_and_broken_files(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        read_records(tmp_path / "nope.jsonl")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match=r"a\.txt: unknown file type '\.txt'"):
        read_records(tmp_path / "a.txt")
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match=r"b\.jsonl\.gz: not a valid gzip file"):
        read_records(tmp_path / "b.jsonl.gz")
    (tmp_path / "c.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"c\.parquet: not a readable Parquet file"):
        read_records(tmp_path / "c.parquet")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"d: not a dataset folder saved with save_to_disk"):
        read_records(tmp_path / "d")
    (tmp_path / "e.json").write_text('[{"a": 1},\n {"a": }]')
    with pytest.raises(DataError, match=r"e\.json: line 2: invalid JSON"):
        read_records(tmp_path / "e.json")


def test_svamp_json_array_reads_if_present():
    path = SHARED_DATA / "svamp" / "SVAMP.json"
    if not path.is_file():
        pytest.skip(f"shared data not found at {path}")
    records = read_records(path)
    assert len(records) == 1000 and records[0][0] == 1 and {"Body", "Question", "Answer"} <= set(records[0][1])


# ------------------------------------------------------------------------------------------------- pairs
def test_transcripts_split_at_the_last_assistant_marker_and_parse_into_turns():
    text = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: 4"
    prompt, reply = split_transcript(text)
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant:" and reply == " 4"
    assert transcript_messages(prompt) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"}]
    assert transcript_messages("What is 2+2?") is None
    assert split_transcript("no marker") is None


def test_both_shapes_and_the_skip_counts(tmp_path):
    t = "\n\nHuman: q\n\nAssistant:"
    rows = [
        ROWS[0],
        {"chosen": t + " good", "rejected": t + " bad"},
        {"chosen": t + " same", "rejected": t + " same"},  # identical
        {"prompt": "p", "chosen": "x", "rejected": "x"},  # identical replies
        {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"},  # no shared prompt
        {"chosen": "plain a", "rejected": "plain b"},  # no marker: no shared prompt
    ]
    pairs, stats = load_preference_pairs([write_jsonl(tmp_path / "p.jsonl", rows)])
    assert pairs == [PreferencePair("2+2=", "4", "5", f"{tmp_path / 'p.jsonl'}: line 1"),
                     PreferencePair(t, " good", " bad", f"{tmp_path / 'p.jsonl'}: line 2")]
    assert (stats.rows, stats.pairs, stats.identical, stats.no_shared_prompt, stats.invalid) == (6, 2, 2, 2, 0)
    assert stats.summary() == "6 rows read, 2 pairs kept; skipped: 2 identical sides, 2 no shared prompt, 0 invalid"


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "rejected": "r"}, "line 2: missing field 'chosen' (found: prompt, rejected)"),
    ({"prompt": "p", "chosen": "  ", "rejected": "r"}, "line 2: field 'chosen' is empty"),
    ({"prompt": "", "chosen": "c", "rejected": "r"}, "line 2: field 'prompt' is empty"),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, "line 2: field 'chosen' must be text, got int"),
])
def test_bad_pair_rows_are_named_or_counted_with_skip_invalid(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], row, ROWS[1]])
    with pytest.raises(DataError) as e:
        load_preference_pairs([path])
    assert str(e.value) == f"{path}: {expected}"
    pairs, stats = load_preference_pairs([path], skip_invalid=True)
    assert len(pairs) == 2 and stats.invalid == 1 and expected in stats.summary()


def test_missing_csv_column_is_a_file_error(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("prompt,chosen,reject\np,c,r\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.csv: missing column 'rejected' \(columns: prompt, chosen, reject\)"):
        load_preference_pairs([path], skip_invalid=True)


def test_no_usable_pairs_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "p", "chosen": "x", "rejected": "x"}])
    with pytest.raises(DataError, match="no usable preference pairs .*1 identical sides"):
        load_preference_pairs([path])


# ------------------------------------------------------------------------------------------ split, balance
def _pairs(n_prompts: int, per_prompt: int) -> list[PreferencePair]:
    return [PreferencePair(f"p{i}", f"c{i}-{j}", f"r{i}-{j}") for i in range(n_prompts) for j in range(per_prompt)]


def test_split_is_by_prompt_deterministic_and_order_independent():
    pairs = _pairs(50, 3)
    train, held_out = split_pairs(pairs, 0.2, seed=7)
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert len(held_out) == 30 and len(train) + len(held_out) == 150
    again = split_pairs(list(reversed(pairs)), 0.2, seed=7)
    assert {p.chosen for p in again[1]} == {p.chosen for p in held_out}
    other = split_pairs(pairs, 0.2, seed=8)
    assert {p.prompt for p in other[1]} != {p.prompt for p in held_out}


def test_split_always_leaves_train_pairs():
    train, held_out = split_pairs(_pairs(2, 1), 0.9, seed=0)
    assert len(train) == 1 and len(held_out) == 1


def test_balance_by_length_equalises_longer_and_shorter():
    pairs = ([PreferencePair("p", "long reply", "short", str(i)) for i in range(30)]
             + [PreferencePair("p", "s", "longer", str(i)) for i in range(10)]
             + [PreferencePair("p", "abc", "xyz", "eq")])
    kept = balance_by_length(pairs, seed=0)
    longer = sum(len(p.chosen) > len(p.rejected) for p in kept)
    shorter = sum(len(p.chosen) < len(p.rejected) for p in kept)
    assert longer == shorter == 10 and any(p.source == "eq" for p in kept) and len(kept) == 21
    assert kept == [p for p in pairs if p in kept]  # order preserved


def _reply_balanced(pairs) -> bool:
    texts = {t for p in pairs for t in (p.chosen.strip(), p.rejected.strip())}
    return all(sum(p.chosen.strip() == t for p in pairs) == sum(p.rejected.strip() == t for p in pairs)
               for t in texts)


def test_balance_by_reply_keeps_the_largest_subset_where_no_reply_is_a_favourite():
    # A -> B -> C -> A is a 3-cycle, but A -> B, B -> A and C -> A, A -> C are two 2-cycles: 4 pairs beat 3 (the two
    # solutions share A -> B and C -> A, so they cannot be combined). " B" is the text "B".
    pairs = [PreferencePair("p1", "A", "B", "ab"), PreferencePair("p2", " B", "C", "bc"),
             PreferencePair("p3", "C", "A", "ca"), PreferencePair("p4", "B", "A", "ba"),
             PreferencePair("p5", "A", "C", "ac")]
    kept = balance_by_reply(pairs, seed=0)
    assert [p.source for p in kept] == ["ab", "ca", "ba", "ac"]


def test_balance_by_reply_matches_a_brute_force_search():
    import itertools

    rng = random.Random(3)
    for trial in range(30):
        pairs = [PreferencePair(f"p{i}", rng.choice("ABCD"), rng.choice("ABCD"), str(i)) for i in range(9)]
        pairs = [p for p in pairs if p.chosen != p.rejected]
        best = max(len(subset) for n in range(len(pairs) + 1) for subset in itertools.combinations(pairs, n)
                   if _reply_balanced(subset))
        kept = balance_by_reply(pairs, seed=trial)
        assert _reply_balanced(kept) and len(kept) == best, trial
        assert kept == [p for p in pairs if p in kept]  # order preserved


def test_balance_by_reply_keeps_a_pair_of_one_text_and_draws_by_seed():
    pairs = [PreferencePair("p", "A", "B", str(i)) for i in range(5)] + [PreferencePair("q", "B", "A", "ba"),
                                                                        PreferencePair("r", "x", "x ", "same")]
    kept = {p.source for p in balance_by_reply(pairs, seed=0)}
    assert "same" in kept and "ba" in kept and len(kept) == 3  # one of the five A -> B pairs
    assert len({frozenset(p.source for p in balance_by_reply(pairs, seed=s)) for s in range(20)}) > 1


# --------------------------------------------------------------------------------------------- real data
def test_helpful_base_loads_with_the_documented_skip_counts():
    path = SHARED_DATA / "hh-rlhf" / "helpful-base-test.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"shared data not found at {path}")
    pairs, stats = load_preference_pairs([path])
    # README: 2,354 pairs, 2 with identical sides, 2,345 share the prompt prefix (so 9 do not)
    assert (stats.rows, stats.identical, stats.no_shared_prompt, stats.invalid) == (2354, 2, 9, 0)
    assert stats.pairs == len(pairs) == 2343
    assert all(p.prompt.endswith("\n\nAssistant:") and p.chosen != p.rejected for p in pairs)
    assert pairs[0].prompt + pairs[0].chosen == json.loads(gzip.open(path, "rt").readline())["chosen"]
