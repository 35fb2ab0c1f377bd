import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.core.io import InputError
from lmforge.curate.readers import InputsConfig, plan_shards, read_piece
from tests.curate.warc_fixtures import PROSE, html_record, write_warc


def read_all(cfg):
    return [item for shard in plan_shards(cfg) for piece in shard for item in read_piece(piece, cfg)]


def test_warc_records_become_documents_with_url_and_content_type(tmp_path):
    path = write_warc(tmp_path / "a.warc.gz", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(3)])
    items = read_all(InputsConfig(paths=[str(path)]))
    assert [r for _, r in items] == [None] * 3  # the warcinfo record is not a document
    doc = items[0][0]
    assert doc.metadata["url"] == "https://x.org/0" and doc.metadata["content_type"] == "text/html"
    assert "<p>The library" in doc.text and doc.id.startswith("urn:uuid:")


def test_bad_warc_payloads_are_rejects_with_reasons(tmp_path):
    path = write_warc(tmp_path / "a.warc.gz", [
        html_record("https://x.org/ok", PROSE["en"]),
        ("https://x.org/latin", "<p>caf\xe9</p>".encode("latin-1"), "text/html; charset=utf-8"),
        ("https://x.org/bin", b"\x89PNG\r\n\x1a\n\0\0\0", "text/html"),
    ])
    reasons = [r for _, r in read_all(InputsConfig(paths=[str(path)]))]
    assert reasons[0] is None
    assert reasons[1].startswith("undecodable-payload") and reasons[2].startswith("binary-payload")


@pytest.mark.parametrize("gzip", [True, False])
def test_truncated_warc_record_is_a_reject_not_a_silent_loss(tmp_path, gzip):
    path = write_warc(tmp_path / ("a.warc.gz" if gzip else "a.warc"),
                      [html_record(f"https://x.org/{i}", PROSE["en"] * 3) for i in range(3)], gzip=gzip)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    items = read_all(InputsConfig(paths=[str(path)]))
    assert len(items) == 3
    assert [r for _, r in items[:2]] == [None, None]
    assert items[2][1].startswith("truncated-record")


def test_a_large_warc_is_split_into_shards_by_record_index(tmp_path):
    path = write_warc(tmp_path / "a.warc.gz", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(7)])
    cfg = InputsConfig(paths=[str(path)], records_per_shard=3)
    shards = plan_shards(cfg)
    assert len(shards) == 3
    urls = [[d.metadata["url"] for p in s for d, _ in read_piece(p, cfg)] for s in shards]
    assert urls == [[f"https://x.org/{i}" for i in r] for r in ([0, 1, 2], [3, 4, 5], [6])]


def test_html_folder_jsonl_parquet_and_text_inputs(tmp_path):
    (tmp_path / "site" / "sub").mkdir(parents=True)
    (tmp_path / "site" / "a.html").write_text("<p>a</p>")
    (tmp_path / "site" / "sub" / "b.htm").write_text("<p>b</p>")
    (tmp_path / "d.jsonl").write_text('{"id": "j1", "text": "hello", "url": "https://j.org"}\n{bad json\n'
                                      '{"id": "j3", "body": "no text"}\n')
    pq.write_table(pa.table({"id": ["p1"], "text": ["from parquet"]}), tmp_path / "e.parquet")
    (tmp_path / "f.txt").write_text("plain")
    cfg = InputsConfig(paths=[str(tmp_path / "site"), str(tmp_path / "d.jsonl"), str(tmp_path / "e.parquet"),
                              str(tmp_path / "f.txt")], records_per_shard=2)
    items = read_all(cfg)
    assert [d.id.rsplit("/", 1)[-1] for d, _ in items] == ["a.html", "b.htm", "j1", "d.jsonl:2", "j3", "p1", "f.txt"]
    reasons = [r.split(":")[0] if r else None for _, r in items]
    assert reasons == [None, None, None, "malformed-json", "missing-text", None, None]
    assert items[2][0].metadata["url"] == "https://j.org" and items[0][0].metadata["content_type"] == "text/html"


def test_missing_input_is_an_input_error_naming_it(tmp_path):
    with pytest.raises(InputError, match="nope.warc.gz"):
        plan_shards(InputsConfig(paths=[str(tmp_path / "nope.warc.gz")]))


def test_jsonl_shards_by_line_cover_every_line_once(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "text": f"t{i}"}) + "\n" for i in range(10)))
    cfg = InputsConfig(paths=[str(path)], records_per_shard=4)
    assert len(plan_shards(cfg)) == 3
    assert [d.id for d, _ in read_all(cfg)] == [str(i) for i in range(10)]
