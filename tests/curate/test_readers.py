import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastwarc.warc import ArchiveIterator

from lmforge.core.io import InputError
from lmforge.curate.readers import InputsConfig, Piece, decode_payload, plan_shards, read_piece
from tests.curate.warc_fixtures import MIXED_PAGES, PROSE, fixed_warc, html_record, record_offsets, write_warc

UNDECODABLE = b"<p>" + bytes(range(0x80, 0x100)) + b"</p>"  # not UTF-8, and 0x81 is in no windows-125x


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
        ("https://x.org/undecodable", UNDECODABLE, "text/html; charset=utf-8"),
        ("https://x.org/bin", b"\x89PNG\r\n\x1a\n\0\0\0", "text/html"),
    ])
    items = read_all(InputsConfig(paths=[str(path)]))
    reasons = [r for _, r in items]
    assert reasons[0] is None
    assert reasons[1] == "undecodable-payload: invalid utf-8 at byte 3 (valid-utf-8, http-header, default)"
    assert reasons[2].startswith("binary-payload")
    assert items[1][0].text.startswith("<p>\ufffd")  # kept in the reject with U+FFFD



SMART = "\u201cSmart\u201d quotes \u2014 it\u2019s a caf\u00e9 in S\u00e3o Paulo, na\u00efve r\u00e9sum\u00e9."
JAPANESE = "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u6771\u4eac\u306e\u56f3\u66f8\u9928"


def _html(body: str, head: str = "") -> str:
    return f"<html><head>{head}<title>t</title></head><body><p>{body}</p></body></html>"


@pytest.mark.parametrize("content_type, payload, text, charset, source", [
    # the charset is declared only in the page, which is not UTF-8
    ("text/html", _html(SMART, '<meta charset="windows-1252">').encode("cp1252"), SMART, "cp1252", "html-meta"),
    ("text/html", _html(JAPANESE, '<meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS">')
     .encode("shift_jis"), JAPANESE, "shift_jis", "html-meta"),
    ("text/html", _html(JAPANESE, "<meta charset=gb2312>").encode("gbk"), JAPANESE, "gbk", "html-meta"),
    # ISO-8859-1 is read as windows-1252, as browsers do: 0x93/0x94 are quotes, not C1 controls
    ("text/html; charset=ISO-8859-1", _html(SMART).encode("cp1252"), SMART, "cp1252", "http-header"),
    ('text/html; charset="latin-1"', _html(SMART).encode("cp1252"), SMART, "cp1252", "http-header"),
    # a lying header: says UTF-8, the page is windows-1252 as its <meta> says
    ("text/html; charset=utf-8", _html(SMART, "<meta charset=windows-1252>").encode("cp1252"), SMART, "cp1252",
     "html-meta"),
    # a lying header the other way: a server's default ISO-8859-1 on a UTF-8 page (no mojibake)
    ("text/html; charset=iso-8859-1", _html(SMART).encode("utf-8"), SMART, "utf-8", "valid-utf-8"),
    # an unknown label is passed over, not a crash
    ("text/html; charset=x-no-such-charset", _html(SMART, "<meta charset='cp1252'>").encode("cp1252"), SMART,
     "cp1252", "html-meta"),
    # a byte order mark outranks every label
    ("text/html; charset=iso-8859-1", "\ufeff".encode() + _html(SMART).encode(), SMART, "utf-8", "bom"),
    ("text/html", "\ufeff".encode("utf-16-le") + _html(SMART).encode("utf-16-le"), SMART, "utf-16-le", "bom"),
    ("text/html", _html("plain ASCII").encode(), "plain ASCII", "utf-8", "default"),
])
def test_warc_pages_are_decoded_in_the_charset_a_browser_would_use(tmp_path, content_type, payload, text, charset,
                                                                   source):
    path = write_warc(tmp_path / "a.warc.gz", [("https://x.org/p", payload, content_type)])
    ((doc, reason),) = read_all(InputsConfig(paths=[str(path)]))
    assert reason is None
    assert f"<p>{text}</p>" in doc.text and not doc.text.startswith("\ufeff")
    assert decode_payload(payload, content_type.partition("charset=")[2] or None, html=True)[1:] == (charset, source)
    # text not read as UTF-8 says how it was read
    assert (doc.metadata.get("charset"), doc.metadata.get("charset_source")) == \
        ((None, None) if charset == "utf-8" else (charset, source))


def test_a_page_not_utf8_that_declares_no_charset_or_a_wrong_one_is_a_reject_naming_what_was_tried(tmp_path):
    undeclared = _html(SMART).encode("cp1252")
    lying = _html(SMART, "<meta charset=shift_jis>").encode("cp1252")
    path = write_warc(tmp_path / "a.warc.gz", [("https://x.org/undeclared", undeclared, "text/html"),
                                               ("https://x.org/lying", lying, "text/html; charset=oops")])
    reasons = [r for _, r in read_all(InputsConfig(paths=[str(path)]))]
    quote = b"\x93"  # the first byte that is not ASCII: no UTF-8 lead byte
    assert reasons[0] == f"undecodable-payload: invalid utf-8 at byte {undeclared.index(quote)} (valid-utf-8, default)"
    assert reasons[1].startswith(f"undecodable-payload: invalid utf-8 at byte {lying.index(quote)} (valid-utf-8, "
                                 "default); unknown charset 'oops' (http-header); invalid shift_jis at byte ")
    assert reasons[1].endswith(" (html-meta)")


def test_html_files_are_decoded_by_their_meta_charset_and_text_files_only_as_utf8(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "a.html").write_bytes(_html(SMART, '<meta charset="windows-1252">').encode("cp1252"))
    (tmp_path / "notes.txt").write_bytes(SMART.encode("cp1252"))
    items = read_all(InputsConfig(paths=[str(tmp_path / "site"), str(tmp_path / "notes.txt")]))
    assert items[0][1] is None and SMART in items[0][0].text and items[0][0].metadata["charset"] == "cp1252"
    assert items[1][1].startswith("undecodable-payload: invalid utf-8 at byte 0")

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


def _jsonl_with_every_kind_of_line(path, n, gzip_it):
    """n lines: documents with and without ids, a blank line, malformed JSON, invalid UTF-8, a non-object,
    a record without text, and a last line with no newline."""
    lines = []
    for i in range(n):
        kind = i % 8
        lines.append([json.dumps({"id": f"{path.stem}-{i}", "text": f"t{i}", "n": i}).encode(),
                      json.dumps({"text": f"no id {i}"}).encode(), b"  ", b'{"text": "cut',
                      b'{"text": "caf\xe9"}', b"[1, 2]", json.dumps({"body": i}).encode(), b"null"][kind])
    data = b"\n".join(lines)  # no newline after the last line
    path.write_bytes(gzip.compress(data) if gzip_it else data)
    return path


def _items(pairs):
    return [(d.id, d.text, d.metadata, reason) for d, reason in pairs]


@pytest.mark.parametrize("gzip_it", [False, True])
def test_jsonl_shards_read_the_same_documents_ids_and_problems_as_the_whole_file(tmp_path, gzip_it):
    suffix = ".jsonl.gz" if gzip_it else ".jsonl"
    small = _jsonl_with_every_kind_of_line(tmp_path / f"small{suffix}", 3, gzip_it)
    big = _jsonl_with_every_kind_of_line(tmp_path / f"big{suffix}", 45, gzip_it)
    cfg = InputsConfig(paths=[str(small), str(big)], records_per_shard=7)  # big's first piece fills a shard's rest
    pieces = [p for shard in plan_shards(cfg) for p in shard if p.path == str(big)]
    assert len(pieces) == 7 and all(p.offset is not None for p in pieces)
    whole = [item for path in (small, big) for item in read_piece(Piece(str(path), "jsonl", 0, 1 << 62), cfg)]
    assert _items(read_all(cfg)) == _items(whole)
    reasons = {r.split(":")[0] for _, r in whole if r}
    assert reasons == {"malformed-json", "invalid-utf8", "not-an-object", "missing-text"}
    assert f"{big.name}:2" in [d.id for d, _ in whole]  # the fallback id names the line


@pytest.mark.parametrize("gzip_it", [False, True])
def test_a_jsonl_shard_parses_only_its_own_lines(tmp_path, gzip_it, monkeypatch):
    path = tmp_path / ("d.jsonl.gz" if gzip_it else "d.jsonl")
    data = "".join(json.dumps({"id": str(i), "text": f"t{i}"}) + "\n" for i in range(12)).encode()
    path.write_bytes(gzip.compress(data) if gzip_it else data)
    cfg = InputsConfig(paths=[str(path)], records_per_shard=4)
    second = plan_shards(cfg)[1]
    parsed = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **kw: parsed.append(s) or loads(s, *a, **kw))
    assert [d.id for p in second for d, _ in read_piece(p, cfg)] == ["4", "5", "6", "7"]
    assert len(parsed) == 4


def _warc_layout(tmp_path, layout, damage):
    records = [html_record(f"https://x.org/{i}", PROSE["en"] * (1 + i % 3)) for i in range(6)]
    records[2] = ("https://x.org/undecodable", UNDECODABLE, "text/html; charset=utf-8")
    if layout == "one-member.warc.gz":  # the whole file one gzip stream: stream_pos is no place to seek to
        path = write_warc(tmp_path / "a.warc", records, gzip=False)
        path = path.rename(tmp_path / layout)
        path.write_bytes(gzip.compress(path.read_bytes()))
    else:
        path = write_warc(tmp_path / f"a.{layout}", records, gzip=layout.endswith(".gz"))
    data = path.read_bytes()
    if damage == "truncated":  # the last record cut short
        path.write_bytes(data[:-200])
    elif damage == "cut-off-record-more":  # a 7th record, too short to have an id or (.gz) to be parsed at all
        with open(path, "rb") as f:
            last = [r.stream_pos for r in ArchiveIterator(f)][-1]
        path.write_bytes(data + data[last:last + 30])
    return path


@pytest.mark.parametrize("layout, damage", [
    ("warc", None), ("warc", "truncated"), ("warc", "cut-off-record-more"),
    ("warc.gz", None), ("warc.gz", "truncated"), ("warc.gz", "cut-off-record-more"),
    ("one-member.warc.gz", None),
])
def test_warc_shards_read_the_same_documents_ids_and_problems_as_the_whole_file(tmp_path, layout, damage):
    path = _warc_layout(tmp_path, layout, damage)
    cfg = InputsConfig(paths=[str(path)], records_per_shard=2)
    pieces = [p for shard in plan_shards(cfg) for p in shard]
    whole = list(read_piece(Piece(str(path), "warc", 0, 1 << 62), cfg))
    assert len(pieces) == (len(whole) + 1) // 2 >= 3
    assert _items(read_all(cfg)) == _items(whole)
    truncated = damage in ("truncated", "cut-off-record-more")  # a record cut inside its header is one too
    assert [r.split(":")[0] for _, r in whole if r] == ["undecodable-payload"] + ["truncated-record"] * truncated
    # pieces start at records 0, 2, 4 (and 6, the cut-off record, which is read from the file's top)
    seekable = [p.offset is not None for p in pieces]
    assert seekable[:3] == [layout != "one-member.warc.gz"] * 3
    assert seekable[3:] == ([False] if damage == "cut-off-record-more" else [])


@pytest.mark.parametrize("gzip_it", [False, True])
def test_a_warc_shard_seeks_past_the_records_before_it(tmp_path, gzip_it):
    path = write_warc(tmp_path / ("a.warc.gz" if gzip_it else "a.warc"),
                      [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(9)], gzip=gzip_it)
    cfg = InputsConfig(paths=[str(path)], records_per_shard=3)
    (piece,) = plan_shards(cfg)[1]
    with open(path, "rb") as f:
        cut = [r.stream_pos for r in ArchiveIterator(f)][4]  # after the warcinfo record and records 0-2
    data = path.read_bytes()
    path.write_bytes(b"x" * cut + data[cut:])  # the first shard's records, unreadable now
    assert [d.metadata["url"] for d, _ in read_piece(piece, cfg)] == [f"https://x.org/{i}" for i in (3, 4, 5)]


def test_lone_surrogates_and_invalid_utf8_strings_are_read_rejects_naming_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"id": "ok", "text": "fine"}\n'
                     b'{"text": "abc \\ud800 def"}\n'
                     b'{"id": "pair", "text": "smile \\ud83d\\ude00"}\n'
                     b'{"id": "meta", "text": "fine", "url": "https://x.org/\\udc80"}\n'
                     b'{"id": "key", "text": "fine", "\\udfff": 1}\n')
    table = pa.table({"id": ["p1", "p2"], "text": ["good", "good"]})
    data = b"abc \xed\xa0\x80 def"  # a surrogate encoded as UTF-8: invalid, but a Parquet writer may store it
    offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(data)])
    pq.write_table(pa.table({"id": ["p0", "p1", "p2"], "text": pa.concat_arrays([table["text"].chunks[0][:1], bad,
                                                                                table["text"].chunks[0][1:]])}),
                   tmp_path / "e.parquet")
    items = read_all(InputsConfig(paths=[str(path), str(tmp_path / "e.parquet")]))
    assert [(d.id, r) for d, r in items] == [
        ("ok", None),
        ("d.jsonl:2", f"invalid-unicode: {path}:2: lone surrogate at character 4 of field 'text'"),
        ("pair", None),
        ("meta", f"invalid-unicode: {path}:4: lone surrogate at character 14 of field 'url'"),
        ("key", f"invalid-unicode: {path}:5: lone surrogate in field '\\udfff'"),
        ("p0", None),
        ("p1", f"invalid-utf8: {tmp_path / 'e.parquet'}:row 2: invalid UTF-8 at byte 4 of column 'text'"),
        ("p2", None)]
    assert items[1][0].text == "abc \ufffd def" and items[2][0].text == "smile \U0001F600"
    assert items[6][0].text.startswith("abc \ufffd")
    for doc, _ in items:  # every one, kept or rejected, can be written out
        json.dumps([doc.id, doc.text, doc.metadata], ensure_ascii=False).encode("utf-8")


def _damage_member(data: bytes, starts: list[int], k: int, how: str) -> tuple[bytes, int, int]:
    """The file with record k's gzip member damaged, and the byte range [a, b) that can no longer be read."""
    a, b = starts[k], starts[k + 1]
    if how == "deflate-data":  # bits flipped inside the compressed stream
        return data[:a + 40] + bytes(x ^ 0x55 for x in data[a + 40:a + 60]) + data[a + 60:], a, b
    if how == "checksum":  # the stream inflates, but to other bytes than were written
        return data[:b - 8] + bytes(x ^ 0xFF for x in data[b - 8:b - 4]) + data[b - 4:], a, b
    if how == "gzip-header":
        return data[:a] + b"\0\0" + data[a + 2:], a, b
    if how == "cut-short":  # the member's second half lost, the next member follows at once
        cut = (a + b) // 2
        return data[:cut] + data[b:], a, cut
    assert how == "garbage-between"  # no record damaged, 64 bytes that are no gzip member before record k
    return data[:a] + b"not a gzip member " * 4 + data[a:], a, a + 72


@pytest.mark.parametrize("how", ["deflate-data", "checksum", "gzip-header", "cut-short", "garbage-between"])
def test_a_damaged_gzip_member_is_a_reject_naming_file_and_bytes_and_reading_goes_on(tmp_path, how):
    path = write_warc(tmp_path / "a.warc.gz", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(6)])
    starts = record_offsets(path)  # warcinfo, then records 0-5
    data, a, b = _damage_member(path.read_bytes(), starts, 3, how)  # record 2's member
    path.write_bytes(data)
    cfg = InputsConfig(paths=[str(path)], records_per_shard=2)
    whole = list(read_piece(Piece(str(path), "warc", 0, 1 << 62), cfg))
    lost = [] if how == "garbage-between" else [2]
    assert [d.metadata.get("url") for d, r in whole if r is None] == [f"https://x.org/{i}" for i in range(6)
                                                                     if i not in lost]
    (reject,) = [(d, r) for d, r in whole if r is not None]
    assert reject[0].metadata["offset"] == a and reject[0].id == f"{path}@{a}"
    assert reject[1].startswith(f"damaged-gzip-member: {path}: the gzip member at byte {a} is damaged (")
    assert reject[1].endswith(f"; bytes {a}-{b} skipped, reading resumes at byte {b}")
    assert _items(read_all(cfg)) == _items(whole)  # shards that seek past the damage, or read through it, agree


def test_damage_in_the_last_gzip_member_skips_to_the_end_of_the_file(tmp_path):
    path = write_warc(tmp_path / "a.warc.gz", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(3)])
    starts = record_offsets(path) + [path.stat().st_size]
    data, a, b = _damage_member(path.read_bytes(), starts, 3, "deflate-data")
    path.write_bytes(data)
    items = read_all(InputsConfig(paths=[str(path)]))
    assert [r for _, r in items[:2]] == [None, None]
    assert items[2][1].startswith(f"damaged-gzip-member: {path}: the gzip member at byte {a} is damaged")
    assert items[2][1].endswith(f"; bytes {a}-{b} skipped")


def test_an_unparsable_uncompressed_warc_is_an_input_error_naming_file_and_byte(tmp_path):
    path = write_warc(tmp_path / "a.warc", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(4)],
                      gzip=False)
    starts = record_offsets(path)
    data = path.read_bytes()
    path.write_bytes(data[:starts[3]] + b"garbage\r\n" + data[starts[3]:])
    with pytest.raises(InputError, match=f"{path}: cannot read WARC after the record at byte {starts[2]}"):
        read_all(InputsConfig(paths=[str(path)]))


def test_windows_1252_decodes_its_five_undefined_bytes_as_browsers_do():
    # Python's cp1252 refuses 0x81, 0x8D, 0x8F, 0x90, 0x9D; the WHATWG windows-1252 makes them C1 controls
    text, codec, source = decode_payload(b"caf\xe9 \x81\x8d\x8f\x90\x9d \x93q\x94", "iso-8859-1", html=True)
    assert (text, codec, source) == ("caf\u00e9 \x81\x8d\x8f\x90\x9d \u201cq\u201d", "cp1252", "http-header")
    assert decode_payload(b"a\x81 b", "shift_jis", html=True)[0] is None  # other codecs stay strict


@pytest.mark.parametrize("member", [
    b"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:x>\r\nContent-Length: abc\r\n\r\nhello\r\n\r\n",
    b"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:x>\r\n\r\nhello\r\n\r\n",  # no Content-Length
    b"WARC/garbage",
])
def test_a_whole_gzip_member_with_a_malformed_warc_record_is_one_counted_reject(tmp_path, member):
    path = write_warc(tmp_path / "a.warc.gz", [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(6)])
    data, bad = path.read_bytes(), record_offsets(path)[3]  # before https://x.org/2
    packed = gzip.compress(member)
    path.write_bytes(data[:bad] + packed + data[bad:])
    cfg = InputsConfig(paths=[str(path)], records_per_shard=2)
    whole = list(read_piece(Piece(str(path), "warc", 0, 1 << 62), cfg))
    assert [d.metadata["url"] for d, r in whole if r is None] == [f"https://x.org/{i}" for i in range(6)]
    end = bad + len(packed)
    assert [r for _, r in whole if r] == [f"damaged-gzip-member: {path}: the gzip member at byte {bad} holds no "
                                          f"well-formed WARC record; bytes {bad}-{end} skipped, reading resumes at byte {end}"]
    assert _items(read_all(cfg)) == _items(whole)  # read in shards alike


def _three_pages(path, gz):
    return write_warc(path, [html_record(f"https://x.org/{i}", PROSE["en"]) for i in range(3)], gzip=gz)


def test_a_warc_cut_anywhere_inside_its_last_record_header_is_a_counted_truncated_record(tmp_path):
    path = _three_pages(tmp_path / "a.warc", gz=False)
    data, last = path.read_bytes(), record_offsets(path)[-1]
    header_end = data.index(b"\r\n\r\n", data.index(b"\r\n\r\n", last) + 4) + 4  # the WARC and HTTP headers
    for cut in range(last + 1, header_end + 2):
        path.write_bytes(data[:cut])
        items = read_all(InputsConfig(paths=[str(path)]))
        assert [r for _, r in items[:2]] == [None, None], cut
        assert len(items) == 3 and (items[2][1] or "").startswith("truncated-record"), (cut, items[2:])


def test_a_warc_gz_member_holding_a_cut_record_header_is_a_counted_truncated_record(tmp_path):
    path = _three_pages(tmp_path / "a.warc.gz", gz=True)
    data, last = path.read_bytes(), record_offsets(path)[-1]
    content = gzip.decompress(data[last:])
    header_end = content.index(b"\r\n\r\n", content.index(b"\r\n\r\n") + 4) + 4
    for cut in range(1, header_end + 2, 3):
        path.write_bytes(data[:last] + gzip.compress(content[:cut]))  # a whole member, its record cut short
        items = read_all(InputsConfig(paths=[str(path)]))
        assert [r for _, r in items[:2]] == [None, None], cut
        assert len(items) == 3 and (items[2][1] or "").startswith("truncated-record"), (cut, items[2:])


def test_a_warc_gz_member_with_a_cut_header_in_the_middle_is_a_counted_truncated_record(tmp_path):
    path = _three_pages(tmp_path / "a.warc.gz", gz=True)
    data, offsets = path.read_bytes(), record_offsets(path)
    content = gzip.decompress(data[offsets[2]:offsets[3]])
    path.write_bytes(data[:offsets[2]] + gzip.compress(content[:120]) + data[offsets[3]:])
    items = read_all(InputsConfig(paths=[str(path)]))
    assert [d.metadata.get("url") for d, r in items if r is None] == ["https://x.org/0", "https://x.org/2"]
    assert [r.split(":")[0] for _, r in items if r] == ["truncated-record"]


def test_an_uncompressed_warc_cut_inside_a_middle_record_header_is_an_error_naming_file_and_byte(tmp_path):
    path = _three_pages(tmp_path / "a.warc", gz=False)
    data, offsets = path.read_bytes(), record_offsets(path)
    path.write_bytes(data[:offsets[2] + 120] + data[offsets[3]:])  # no gzip member to resume at
    with pytest.raises(InputError, match=f"{path}: cannot read WARC after the record at byte {offsets[2]}"):
        read_all(InputsConfig(paths=[str(path)]))


def test_a_parquet_file_damaged_partway_is_a_reject_for_the_rows_lost(tmp_path):
    from tests.data.test_documents import damaged_parquet

    path = damaged_parquet(tmp_path / "d.parquet")
    items = read_all(InputsConfig(paths=[str(path)], records_per_shard=0))
    assert [d.text for d, r in items if r is None] == ["document 0", "document 1"]
    assert [r for _, r in items if r] == [f"unreadable-file: {path}:row 3: damaged Parquet data (" +
                                          items[-1][1].split("damaged Parquet data (", 1)[1]]


def test_a_gzip_member_running_into_a_copy_of_the_file_is_a_counted_reject(tmp_path):
    # found by tests/reliability/test_fuzz_readers.py: the file, then the file again from 2 bytes before its end
    data = fixed_warc(MIXED_PAGES)
    path = tmp_path / "a.warc.gz"
    path.write_bytes(data[:1518] + data + data[1518:])
    items = read_all(InputsConfig(paths=[str(path)], records_per_shard=0))
    # the first copy up to the cut, then the whole second copy
    assert [d.metadata.get("url") for d, r in items if r is None] == ["https://x.org/a"] + ["https://x.org/a", "https://x.org/c"]
    assert any(r.startswith(f"damaged-gzip-member: {path}: the gzip member at byte ") for _, r in items if r)
