import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig, SkipLog, read_documents, split_of


def read(paths, skip=False, skipped=None, **kw):
    return list(read_documents(DocumentsConfig(paths=[str(p) for p in paths], skip_bad_records=skip, **kw), skipped))


def test_jsonl_documents_keep_ids_and_default_to_file_and_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "x", "text": "hello"}\n\n{"text": "world"}\n')
    docs = read([p])
    assert [(d.id, d.text) for d in docs] == [("x", "hello"), ("a.jsonl:3", "world")]


def test_gzipped_jsonl_is_read(tmp_path):
    p = tmp_path / "a.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write('{"text": "zipped"}\n')
    assert [d.text for d in read([p])] == ["zipped"]


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"text": "ok"', r"bad\.jsonl:2: malformed JSON"),
        (b'{"text": "caf\xe9"}', r"bad\.jsonl:2: invalid UTF-8 at byte 13"),
        (b'{"body": "no text"}', r"bad\.jsonl:2: no 'text' field"),
        (b'{"text": 42}', r"bad\.jsonl:2: 'text' is int, not a string"),
        (b"[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_jsonl_record_is_an_error_naming_file_and_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "good"}\n' + line + b"\n")
    with pytest.raises(InputError, match=message):
        read([p])


def test_bad_records_are_skipped_and_counted_when_asked(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "good"}\n{oops\n{"text": "caf\xe9"}\n{"x": 1}\n{"text": ""}\n{"text": "also good"}\n')
    skipped = SkipLog()
    docs = read([p], skip=True, skipped=skipped)
    assert [d.text for d in docs] == ["good", "also good"]
    assert skipped.to_dict()["by_reason"] == {"empty_text": 1, "invalid_utf8": 1, "malformed_json": 1, "missing_text": 1}
    assert skipped.total == 4 and any("bad.jsonl:2" in e for e in skipped.examples)


def test_parquet_documents_and_null_text(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["one", None, "three"]}), p)
    with pytest.raises(InputError, match=r"d\.parquet:row 2: 'text' is null"):
        read([p])
    skipped = SkipLog()
    assert [(d.id, d.text) for d in read([p], skip=True, skipped=skipped)] == [("a", "one"), ("c", "three")]
    assert skipped.by_reason["missing_text"] == 1


def test_parquet_without_text_column_names_the_columns(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x"]}), p)
    with pytest.raises(InputError, match=r"no 'text' column \(columns: \['body'\]\)"):
        read([p])


def test_plain_text_file_is_one_document_and_invalid_utf8_names_the_line(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("line one\nline two\n")
    bad.write_bytes(b"fine\nstill fine\nbroken \xff here\n")
    assert [(d.id, d.text) for d in read([good])] == [("a.txt", "line one\nline two\n")]
    with pytest.raises(InputError, match=r"b\.txt:3: invalid UTF-8"):
        read([bad])


def test_custom_text_field(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"content": "c"}) + "\n")
    assert [d.text for d in read([p], text_field="content")] == ["c"]


def test_a_path_that_matches_nothing_is_an_error(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        read([tmp_path / "missing" / "*.jsonl"])
    with pytest.raises(InputError, match="matches no file"):
        read([tmp_path / "missing.jsonl"])


def test_split_is_a_stable_hash_of_the_id():
    ids = [f"doc-{i}" for i in range(20000)]
    val = [i for i in ids if split_of(i, 0.1) == "val"]
    assert 0.09 < len(val) / len(ids) < 0.11
    assert val == [i for i in ids if split_of(i, 0.1) == "val"]  # same answer every time
    assert set(val) <= {i for i in ids if split_of(i, 0.2) == "val"}  # growing the fraction only adds
    assert all(split_of(i, 0.0) == "train" for i in ids[:100])


def test_jsonl_records_accept_a_byte_order_mark_on_the_first_line_only(tmp_path):
    from lmforge.data.documents import BadRecord, jsonl_records

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\xef\xbb\xbf{"text": "b"}\n')
    (first, a), (second, b) = jsonl_records(path)
    assert first.endswith("bom.jsonl:1") and a == {"text": "a"}
    assert second.endswith("bom.jsonl:2") and isinstance(b, BadRecord)  # a BOM mid-file is not a file's start


def _lines(n):
    return b"".join(b'{"text": "document %d"}\n' % i for i in range(n))


def test_a_truncated_gzip_jsonl_is_an_error_naming_the_file_and_the_last_line_read(tmp_path):
    p = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(_lines(2000))
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.jsonl\.gz:\d+: .*cut short"):
        read([p])


def test_a_truncated_gzip_jsonl_keeps_the_lines_before_the_cut_when_skipping(tmp_path):
    p, q = tmp_path / "cut.jsonl.gz", tmp_path / "next.jsonl"
    data = gzip.compress(_lines(2000))
    p.write_bytes(data[: len(data) // 2])
    q.write_bytes(b'{"text": "after"}\n')
    skipped = SkipLog()
    docs = read([p, q], skip=True, skipped=skipped)
    assert 0 < len(docs) - 1 < 2000 and docs[-1].text == "after"  # reading goes on with the next file
    assert skipped.by_reason == {"damaged_file": 1}
    assert f"cut.jsonl.gz:{len(docs)}:" in skipped.examples[0]  # the line after the last one read


def test_a_file_named_gz_that_is_not_gzip_is_an_error_naming_it(tmp_path):
    p = tmp_path / "plain.jsonl.gz"
    p.write_bytes(_lines(3))
    with pytest.raises(InputError, match=r"plain\.jsonl\.gz:1: .*not a gzip file"):
        read([p])
    skipped = SkipLog()
    assert read([p], skip=True, skipped=skipped) == [] and skipped.by_reason == {"damaged_file": 1}


def test_a_truncated_gzip_text_file_is_an_error_naming_it(tmp_path):
    p = tmp_path / "notes.txt.gz"
    data = gzip.compress(b"some words\n" * 5000)
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"notes\.txt\.gz: .*cut short"):
        read([p])


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"])
def test_nan_and_infinite_numbers_in_jsonl_are_bad_records(tmp_path, number):
    p = tmp_path / "n.jsonl"
    p.write_bytes(b'{"text": "good"}\n{"text": "x", "score": ' + number + b'}\n')
    with pytest.raises(InputError, match=r"n\.jsonl:2: .*not a finite number"):
        read([p])
    skipped = SkipLog()
    assert [d.text for d in read([p], skip=True, skipped=skipped)] == ["good"]
    assert skipped.by_reason == {"non_finite_number": 1}


@pytest.mark.parametrize("line", [b"[" * 5000, b'{"text": "a", "m": ' + b"[" * 900 + b'"\\u0041"' + b"]" * 900 + b"}",
                                  b'{"text": "a", "m": ' + b"{\"k\": " * 101 + b"1" + b"}" * 101 + b"}"])
def test_json_nested_more_than_100_levels_deep_is_a_bad_record(tmp_path, line):
    p = tmp_path / "deep.jsonl"
    p.write_bytes(b'{"text": "good"}\n' + line + b"\n")
    with pytest.raises(InputError, match=r"deep\.jsonl:2: JSON nested more than 100 levels deep"):
        read([p])
    skipped = SkipLog()
    assert [d.text for d in read([p], skip=True, skipped=skipped)] == ["good"]
    assert skipped.by_reason == {"too_deep": 1}


def damaged_parquet(path, rows: int = 6):
    """A Parquet file of ``rows`` documents in row groups of 2 whose second row group's page header is garbage."""
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(rows)]}), path, row_group_size=2)
    offset = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path


def test_a_parquet_file_damaged_partway_is_an_error_naming_the_first_row_lost(tmp_path):
    p = damaged_parquet(tmp_path / "d.parquet")
    with pytest.raises(InputError, match=r"d\.parquet:row 3: damaged Parquet data"):
        read([p])
    skipped = SkipLog()
    assert [d.text for d in read([p], skip=True, skipped=skipped)] == ["document 0", "document 1"]
    assert skipped.by_reason == {"damaged_file": 1}


def test_a_control_character_in_a_json_string_is_named_once_with_its_column_and_the_skip_key(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "good"}\n{"text": "tab\there"}\n')
    with pytest.raises(InputError) as exc:
        read([p])
    assert str(exc.value) == (f"{p}:2: malformed JSON: Invalid control character at column 14 "
                              "(set data.skip_bad_records=true to skip and count such records)")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"}]
CHAT_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"


def test_conversations_are_read_as_their_chatml_text_from_jsonl_and_parquet(tmp_path):
    from lmforge.data.chatml import render_chatml

    assert "".join(s for s, _ in render_chatml(CHAT)) == CHAT_TEXT  # what SFT renders
    j, p = tmp_path / "c.jsonl", tmp_path / "c.parquet"
    j.write_text(json.dumps({"messages": CHAT, "task": "arithmetic"}) + "\n" + json.dumps({"id": "q", "messages": CHAT[1:2]}) + "\n")
    pq.write_table(pa.table({"messages": [CHAT]}), p)
    docs = read([j, p], messages_field="messages")
    assert [(d.id, d.text) for d in docs] == [("c.jsonl:1", CHAT_TEXT), ("q", "<|im_start|>user\n2 + 2?<|im_end|>\n"),
                                              ("c.parquet:1", CHAT_TEXT)]


@pytest.mark.parametrize("record, reason, message", [
    ({"text": "no conversation"}, "missing_messages", r"c\.jsonl:2: no 'messages' field \(keys: \['text'\]\)"),
    ({"messages": "hi"}, "bad_messages", r"c\.jsonl:2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role", r"c\.jsonl:2: messages\[0\] has unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": " "}]}, "empty_turn", r"c\.jsonl:2: messages\[0\] \(user\) is empty"),
])
def test_a_bad_conversation_is_an_error_naming_the_line_or_is_counted(tmp_path, record, reason, message):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(InputError, match=message):
        read([p], messages_field="messages")
    skipped = SkipLog()
    assert [d.text for d in read([p], skip=True, skipped=skipped, messages_field="messages")] == [CHAT_TEXT]
    assert dict(skipped.by_reason) == {reason: 1}


def test_conversations_from_a_plain_text_file_or_a_missing_column_are_errors(tmp_path):
    t, p = tmp_path / "a.txt", tmp_path / "d.parquet"
    t.write_text("prose\n")
    pq.write_table(pa.table({"text": ["x"]}), p)
    with pytest.raises(InputError, match=r"a\.txt: data\.messages_field='messages' reads conversations from JSONL or Parquet"):
        read([t], messages_field="messages")
    with pytest.raises(InputError, match=r"no 'messages' column \(columns: \['text'\]\)"):
        read([p], messages_field="messages")
