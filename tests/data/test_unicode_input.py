"""Text that JSON allows but UTF-8 cannot hold (a lone surrogate escape) is bad input: a clear
error naming the file and line, or a counted skip, never a traceback from the tokenizer."""

from __future__ import annotations

import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig, SkipLog, read_documents


def write(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a fine document"}\n{"text": "broken \\ud800 here"}\n{"text": "another one"}\n')
    return path


def test_a_lone_surrogate_is_an_error_naming_the_file_and_line(tmp_path):
    path = write(tmp_path)
    with pytest.raises(InputError, match=rf"{path}:2: lone surrogate at character 7 of field .text., which no UTF-8 text can hold"):
        list(read_documents(DocumentsConfig(paths=[str(path)])))


def test_a_lone_surrogate_is_skipped_and_counted_when_asked(tmp_path):
    skipped = SkipLog()
    docs = list(read_documents(DocumentsConfig(paths=[str(write(tmp_path))], skip_bad_records=True), skipped))
    assert [d.text for d in docs] == ["a fine document", "another one"]
    assert dict(skipped.by_reason) == {"invalid_unicode": 1}


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tokenizer_dir):
    from lmforge.data.tokenizer import Tokenizer

    return Tokenizer.load(chat_tokenizer_dir)


def test_sft_and_preference_data_with_a_lone_surrogate_are_bad_records(tmp_path, chat_tokenizer):
    from lmforge.data.chat import read_sft_examples
    from lmforge.data.preference import read_preference_pairs

    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt": "say hi", "completion": "hi"}\n'
                   '{"messages": [{"role": "user", "content": "hi \\udc00"}, {"role": "assistant", "content": "ok"}]}\n')
    with pytest.raises(InputError, match=rf"{sft}:2: lone surrogate in field 'messages'"):
        list(read_sft_examples([str(sft)], chat_tokenizer, 64))
    skipped = SkipLog()
    assert len(list(read_sft_examples([str(sft)], chat_tokenizer, 64, on_bad="skip", skipped=skipped))) == 1
    assert dict(skipped.by_reason) == {"invalid_unicode": 1}

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2+2=", "chosen": "4", "rejected": "\\ud83d"}\n')  # half of an emoji's pair
    with pytest.raises(InputError, match=rf"{pairs}:1: .*lone surrogate at character 0 of field 'rejected'"):
        list(read_preference_pairs([str(pairs)], chat_tokenizer, 64))


def bad_parquet(path, column="text", **columns):
    """A Parquet file whose ``column`` holds invalid UTF-8 in row 2 (writers need not check)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"abc \xed\xa0\x80 def"  # a surrogate encoded as UTF-8
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(data)])
    text = pa.concat_arrays([pa.array(["good one"]), bad, pa.array(["good two"])])
    pq.write_table(pa.table({column: text, **columns}), path)
    return path


def test_invalid_utf8_in_a_parquet_string_is_a_bad_record_for_prepare_and_sft(tmp_path, chat_tokenizer):
    from lmforge.data.chat import read_sft_examples

    docs = bad_parquet(tmp_path / "docs.parquet")
    with pytest.raises(InputError, match=rf"{docs}:row 2: invalid UTF-8 at byte 4 of column 'text'"):
        list(read_documents(DocumentsConfig(paths=[str(docs)])))
    skipped = SkipLog()
    kept = list(read_documents(DocumentsConfig(paths=[str(docs)], skip_bad_records=True), skipped))
    assert [d.text for d in kept] == ["good one", "good two"] and dict(skipped.by_reason) == {"invalid_utf8": 1}

    sft = bad_parquet(tmp_path / "sft.parquet", "prompt", completion=["a", "b", "c"])
    with pytest.raises(InputError, match=rf"{sft}:row 2: invalid UTF-8 at byte 4 of column 'prompt'"):
        list(read_sft_examples([str(sft)], chat_tokenizer, 64))
