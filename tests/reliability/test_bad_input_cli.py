"""Bad input through the command line: one line naming the file (and line), exit 2, no traceback."""

from __future__ import annotations

import gzip

import pytest

from lmforge.cli.main import main
from tests.curate.warc_fixtures import write_warc


def error_line(capsys, verb: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"lmforge {verb}: error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("verb", ["prepare", "tokenizer"])
@pytest.mark.parametrize("damage", ["truncated", "not-gzip"])
def test_a_damaged_jsonl_gz_is_a_one_line_error_naming_the_file_and_line(tmp_path, small_tokenizer_dir, capsys,
                                                                        verb, damage):
    path = tmp_path / "docs.jsonl.gz"
    lines = b"".join(b'{"text": "document number %d"}\n' % i for i in range(3000))
    packed = gzip.compress(lines)
    path.write_bytes(packed[: len(packed) // 2] if damage == "truncated" else lines)
    keys = [f"tokenizer={small_tokenizer_dir}"] if verb == "prepare" else ["tokenizer.vocab_size=300"]
    assert main([verb, f"data.paths=[{path}]", f"run_dir={tmp_path}/out", *keys]) == 2
    line = error_line(capsys, verb)
    assert f"{path}:" in line and ("cut short" if damage == "truncated" else "not a gzip file") in line
    # with skip_bad_records the lines before the damage are used, and the damage is counted
    if damage == "truncated" and verb == "prepare":
        assert main([verb, f"data.paths=[{path}]", f"run_dir={tmp_path}/out", *keys, "data.skip_bad_records=true"]) == 0


@pytest.mark.parametrize("name", ["crawl.warc", "crawl.warc.gz"])
def test_curate_of_an_empty_warc_is_a_one_line_error(tmp_path, capsys, name):
    path = tmp_path / name
    path.write_bytes(b"")
    assert main(["curate", f"inputs.paths=[{path}]", f"run_dir={tmp_path}/run", "workers=1"]) == 2
    assert f"no documents in {path}" in error_line(capsys, "curate")


def test_curate_of_a_warc_without_pages_names_the_record_types_it_reads(tmp_path, capsys):
    path = write_warc(tmp_path / "info.warc.gz", [])
    assert main(["curate", f"inputs.paths=[{path}]", f"run_dir={tmp_path}/run", "workers=1"]) == 2
    assert "response, conversion" in error_line(capsys, "curate")
