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
    with pytest.raises(InputError, match=rf"{path}:2: 'text' holds a lone surrogate .* at character 7"):
        list(read_documents(DocumentsConfig(paths=[str(path)])))


def test_a_lone_surrogate_is_skipped_and_counted_when_asked(tmp_path):
    skipped = SkipLog()
    docs = list(read_documents(DocumentsConfig(paths=[str(write(tmp_path))], skip_bad_records=True), skipped))
    assert [d.text for d in docs] == ["a fine document", "another one"]
    assert dict(skipped.by_reason) == {"invalid_unicode": 1}
