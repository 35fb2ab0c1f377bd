"""Input readers for curation: WARC, HTML files, JSONL, Parquet and plain text, cut into shards.

A reader yields ``(Document, None)`` for every record it can read and ``(Document, reason)``
for one it cannot (a WARC record truncated in its payload or its header, a damaged gzip member
of a .warc.gz, after which reading goes on at the next member, an undecodable payload, a
malformed JSONL line, a string with a lone surrogate or invalid UTF-8, which no output could
hold, a Parquet file damaged partway), so bad records become
counted rejects instead of stopping the run or vanishing. A missing or unreadable file, or an
uncompressed WARC that cannot be parsed past some byte, is an ``InputError`` naming it.

Web pages are decoded as browsers decode them (``decode_payload``): byte order mark, valid
UTF-8, the HTTP header's charset, a ``<meta>`` declaration, with labels mapped as the WHATWG
Encoding Standard maps them (ISO-8859-1 is windows-1252).

Sharding: every file's records are numbered; the records of all inputs, in order, are cut
into shards of ``records_per_shard`` (a large WARC becomes several shards, small HTML
files are grouped). ``records_per_shard: 0`` makes one shard per file. The counting pass
notes where each piece's first record begins, so a shard seeks there instead of reading the
records before it: reading a file cut into K shards costs one pass, not K.
"""

from __future__ import annotations

import codecs
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, Literal

from lmforge.core.config import at_least, option
from lmforge.core.io import InputError, expand_paths
from lmforge.data import documents
from lmforge.data.documents import (
    BLANK,
    BadRecord,
    DamagedFile,
    Document,
    jsonl_lines,
    lone_surrogate,
    open_binary,
    open_parquet,
    parquet_batches,
    parquet_rows,
    parse_jsonl_line,
    replace_surrogates,
    unreadable,
)

WARC_SUFFIXES = (".warc", ".warc.gz", ".arc.gz")
HTML_SUFFIXES = (".html", ".htm", ".xhtml")
HTML_TYPES = ("text/html", "application/xhtml+xml")
WARC_RECORD_TYPES = ("warcinfo", "response", "resource", "request", "metadata", "revisit", "conversion", "continuation")
Format = Literal["auto", "warc", "html", "jsonl", "parquet", "text"]


@dataclass
class InputsConfig:
    """Where the raw documents are and how to cut them into shards."""

    paths: list[str] = option(default_factory=list, help="files, globs (``**`` allowed) or folders (their HTML files)")
    format: Format = option(
        "auto", help="auto: by suffix (.warc[.gz], .html/.htm/.xhtml, .jsonl[.gz], .parquet, else text)"
    )
    text_field: str = option("text", help="JSONL key / Parquet column with the text")
    id_field: str = option("id", help="optional; missing ids become <file>:<line>")
    records_per_shard: int = at_least(0, 100, help="0: one shard per file")
    warc_record_types: list[str] = option(
        default_factory=lambda: ["response", "conversion"],
        help="the WARC record types read as documents (warcinfo, response, resource, request, metadata, revisit, "
        "conversion, continuation)",
    )

    def __post_init__(self) -> None:
        if self.records_per_shard < 0:
            raise ValueError(f"records_per_shard must be >= 0, got {self.records_per_shard}")
        unknown = set(self.warc_record_types) - set(WARC_RECORD_TYPES)
        if unknown:
            raise ValueError(f"unknown warc_record_types {sorted(unknown)}; valid: {', '.join(WARC_RECORD_TYPES)}")


@dataclass
class Piece:
    """Records ``[start, stop)`` of one file (record = WARC record of a kept type, JSONL line, Parquet row).

    ``offset`` is where record ``start`` begins, when the counting pass could tell: a byte offset
    in the WARC file, or in the (decompressed) JSONL text. ``None``: read from the file's top.
    """

    path: str
    format: str
    start: int
    stop: int
    offset: int | None = None


def file_format(path: Path, configured: str) -> str:
    if configured != "auto":
        return configured
    name = path.name.lower()
    if name.endswith(WARC_SUFFIXES):
        return "warc"
    if name.endswith(HTML_SUFFIXES):
        return "html"
    return documents.file_format(path)  # jsonl, parquet or text, as `lmforge prepare` decides


def input_files(cfg: InputsConfig) -> list[Path]:
    """Expand paths; a folder stands for the HTML files under it."""
    patterns = []
    for p in cfg.paths:
        if Path(p).is_dir():
            found = sorted(q for q in Path(p).rglob("*") if q.is_file() and q.name.lower().endswith(HTML_SUFFIXES))
            if not found:
                raise InputError(f"input folder {p} holds no .html/.htm/.xhtml file")
            patterns += [str(q) for q in found]
        else:
            patterns.append(p)
    files = expand_paths(patterns, what="input")
    for f in files:
        try:
            with open(f, "rb"):
                pass
        except OSError as exc:
            raise InputError(f"{f}: cannot open input: {exc.strerror or exc}") from exc
    return files


def count_records(path: Path, fmt: str, cfg: InputsConfig,
                  starts: Callable[[int], bool] = lambda index: False) -> tuple[int, dict[int, int]]:
    """The number of records in a file, and the offsets of the records ``starts`` picks that a reader can seek to."""
    if fmt == "warc":
        n, picked = 0, {}
        for n, item in enumerate(_warc_records(path, cfg), start=1):
            if item.record is not None and starts(n - 1):  # not the damaged tail: no record to seek to
                picked[n - 1] = (item.offset, item.record.record_id)
        return n, {i: offset for i, (offset, record_id) in picked.items() if _warc_resumes_at(path, offset, record_id)}
    if fmt == "jsonl":
        n = position = 0
        offsets = {}
        with open_binary(path) as f:
            try:
                for line in f:
                    if starts(n):
                        offsets[n] = position
                    n += 1
                    position += len(line)
            except (OSError, EOFError, zlib.error) as exc:
                raise DamagedFile(path, n + 1, unreadable(exc)) from exc
        return n, offsets
    if fmt == "parquet":
        return open_parquet(path).metadata.num_rows, {}
    return 1, {}


def plan_shards(cfg: InputsConfig) -> list[list[Piece]]:
    """Cut the inputs into shards, each a list of pieces of files, in input order."""
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    room = cfg.records_per_shard
    for path in input_files(cfg):
        fmt = file_format(path, cfg.format)
        if cfg.records_per_shard == 0:
            shards.append([Piece(str(path), fmt, 0, count_records(path, fmt, cfg)[0] if fmt == "warc" else 1 << 62)])
            continue
        n, offsets = count_records(path, fmt, cfg, _piece_starts(room, cfg.records_per_shard))
        start = 0
        while start < n or (n == 0 and start == 0):
            take = min(room, n - start)
            # the last piece of a file reads to its end, so trailing damage is seen by one shard
            stop = start + take if start + take < n else 1 << 62
            current.append(Piece(str(path), fmt, start, stop, offsets.get(start)))
            start += max(take, 1)
            room -= take
            if room == 0:
                shards.append(current)
                current, room = [], cfg.records_per_shard
    if current:
        shards.append(current)
    return shards


def _piece_starts(first: int, every: int) -> Callable[[int], bool]:
    """Whether record ``i`` of a file starts a piece: the first piece fills the current shard's
    remaining ``first`` records, the next ones ``every`` records each."""
    return lambda i: i == 0 or (i >= first and (i - first) % every == 0)


def read_piece(piece: Piece, cfg: InputsConfig) -> Iterator[tuple[Document, str | None]]:
    path = Path(piece.path)
    if piece.format == "warc":
        yield from read_warc(path, cfg, piece.start, piece.stop, piece.offset)
    elif piece.format == "jsonl":
        yield from read_jsonl(path, cfg, piece.start, piece.stop, piece.offset)
    elif piece.format == "parquet":
        yield from read_parquet(path, cfg, piece.start, piece.stop)
    elif piece.start == 0:
        yield from read_whole_file(path, piece.format)


# --------------------------------------------------------------------------- WARC


@dataclass
class _WarcItem:
    record: Any  # a fastwarc WarcRecord, or None for damaged bytes between or after the records
    payload: bytes
    offset: int
    problem: str | None = None


GZIP_MAGIC = b"\x1f\x8b\x08"
ENDS_EARLY = "is cut short at the end of the file"


def _warc_records(path: Path, cfg: InputsConfig, origin: int = 0) -> Iterator[_WarcItem]:
    """Records of the kept types with their payloads, from byte ``origin`` on, and one item per damaged stretch.

    fastwarc stops quietly at a gzip member cut short at the file's end and raises at a damaged
    member in the middle. Either way the reader finds the damaged member itself, reports it with
    the bytes skipped, and goes on at the next gzip member that holds a WARC record (a .warc.gz
    is written one member per record, so only the damaged record is lost). An uncompressed WARC
    that cannot be parsed past some point is an ``InputError`` naming the file and byte offset.
    """
    from fastwarc.warc import ArchiveIterator

    kept = set(cfg.warc_record_types)
    gz = path.name.lower().endswith(".gz")
    start: int | None = origin
    while start is not None:
        last_offset = last_length = None
        pending: _WarcItem | None = None  # the last record is held back until what follows it is checked
        error = cut_tail = None
        try:
            with open(path, "rb") as f:
                f.seek(start)
                for record in ArchiveIterator(f, parse_http=True):
                    last_offset, last_length = record.stream_pos, record.headers.get("Content-Length")
                    if pending is not None:
                        yield pending
                        pending = None
                    # fastwarc makes a record of a header cut short by the end of the file (or of its gzip
                    # member), with no Content-Length and an empty payload: a lost record, whatever its type
                    cut = not (last_length or "").strip().isdigit() and _header_cut_short(path, record.stream_pos, gz)
                    if str(record.record_type) not in kept and not cut:
                        continue
                    payload = record.reader.read()
                    problem = None
                    if cut:
                        problem = (f"truncated-record: {path}: the record at byte {record.stream_pos} ends inside "
                                   f"its header")
                    elif len(payload) < record.content_length:  # fastwarc's content_length is the payload's
                        problem = f"truncated-record: payload has {len(payload)} of {record.content_length} bytes"
                    pending = _WarcItem(record, payload, record.stream_pos, problem)
        except OSError as exc:  # fastwarc raises OSError for damaged data too, with no errno
            if exc.errno is None and not gz:
                cut_tail = _cut_header_tail(path, start if last_offset is None else last_offset, last_length)
            if exc.errno is not None or (not gz and cut_tail is None):
                where = f"after the record at byte {last_offset}" if last_offset is not None else f"at byte {start}"
                raise InputError(f"{path}: cannot read WARC {where}: {exc.strerror or exc}") from exc
            error = exc
        if cut_tail is not None:
            damage = cut_tail, f"truncated-record: {path}: the file ends inside the header of the record at byte {cut_tail}"
            error = None
        elif gz:
            damage = _damaged_gzip_member(path, start, last_offset)
        else:
            damage = _damaged_tail(path, last_offset, start)
        if error is not None and damage is None:  # whole gzip members, but a WARC record fastwarc cannot parse
            damage = _malformed_record_member(path, start if last_offset is None else last_offset)
            if damage is None:
                where = last_offset if last_offset is not None else start
                raise InputError(f"{path}: cannot read WARC after byte {where}: {error}") from error
        start = None
        if damage is not None and gz:
            offset, problem = damage
            start = _next_warc_member(path, offset + 1)
            end = start if start is not None else path.stat().st_size
            # a member of several records was read up to about the last record parsed in it
            first = max(offset, last_offset) if last_offset is not None else offset
            damage = offset, f"{problem}; bytes {first}-{end} skipped" + (f", reading resumes at byte {start}"
                                                                        if start is not None else "")
        if pending is not None and damage is not None and damage[0] == pending.offset:
            pending.problem = pending.problem or damage[1]  # the damaged member is the last record's own
            damage = None
        if pending is not None:
            yield pending
        if damage is not None:
            yield _WarcItem(None, b"", damage[0], damage[1])


def _read_gzip_member(f: BinaryIO, offset: int) -> tuple[int, bytes, str | None]:
    """(end, first bytes of its content, problem) of the gzip member at byte ``offset``; problem None if it is whole."""
    f.seek(offset)
    d = zlib.decompressobj(wbits=31)
    head = b""
    position = offset
    while not d.eof:
        chunk = f.read(1 << 20)
        if not chunk:
            return position, head, ENDS_EARLY
        try:
            out = d.decompress(chunk)
        except zlib.error as exc:
            return position, head, str(exc)
        if len(head) < 8:
            head += out[: 8 - len(head)]
        position += len(chunk)
    return position - len(d.unused_data), head, None


def _damaged_gzip_member(path: Path, origin: int, last_offset: int | None) -> tuple[int, str] | None:
    """(offset, reason) of the first gzip member after the last record parsed from ``origin`` that is not a whole
    member holding a WARC record; None when the rest of the file is only such members (and NUL padding).

    In the standard layout ``last_offset`` is where the last record's member begins. In a file of
    several records per member it is only how far fastwarc's decompressor had got, so the members
    are walked from ``origin`` instead.
    """
    warc = ".warc" in path.name.lower()
    size = path.stat().st_size
    with open(path, "rb") as f:
        position = origin
        if last_offset is not None:
            f.seek(last_offset)
            if f.read(3) == GZIP_MAGIC:
                position = last_offset
            elif last_offset >= size:
                return None
        while position < size:
            end, head, problem = _read_gzip_member(f, position)
            if problem is None and warc and head and not head.startswith(b"WARC/"):  # empty members are padding
                problem = "it holds no WARC record"
            if problem is not None:
                if _blank_from(f, position, b"\0"):
                    return None
                if problem == ENDS_EARLY or (problem == "it holds no WARC record" and cut_header(head)):
                    return position, f"truncated-record: {path}: the gzip member at byte {position} {problem}"
                return position, f"damaged-gzip-member: {path}: the gzip member at byte {position} is damaged ({problem})"
            position = end
    return None


def _malformed_record_member(path: Path, position: int) -> tuple[int, str] | None:
    """(offset, reason) of the first gzip member from ``position`` on whose content is not one
    well-formed WARC record (a ``WARC/`` version line, headers, a numeric Content-Length that the
    member holds), or None. fastwarc may parse such a member into an empty record and then fail
    on the next one, so the walk starts at the last record it parsed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        while position < size:
            f.seek(position)
            d = zlib.decompressobj(wbits=31)
            try:
                content = d.decompress(f.read(1 << 26))  # a member of one record; 64 MiB read at most
            except zlib.error as exc:
                return position, f"damaged-gzip-member: {path}: the gzip member at byte {position} is damaged ({exc})"
            end = position + (f.tell() - position) - len(d.unused_data) if d.eof else size
            head, sep, body = content.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:[ \t]*(\d+)[ \t]*\r?$", head)
            if d.eof and cut_header(content):
                return position, (f"truncated-record: {path}: the gzip member at byte {position} ends inside a "
                                  f"WARC record header")
            if not (content.startswith(b"WARC/") and sep and length and len(body) >= int(length.group(1))):
                return position, (f"damaged-gzip-member: {path}: the gzip member at byte {position} holds no "
                                  f"well-formed WARC record")
            if not d.eof:
                return None
            position = end
    return None


VERSION_PREFIX = re.compile(rb"W(A(R(C(/(\d+(\.\d*)?)?)?)?)?)?\r?")  # "WARC/1.0" cut anywhere
VERSION_LINE = re.compile(rb"WARC/\d+\.\d+\r?\n")


def cut_header(content: bytes) -> bool:
    """Whether ``content`` is the start of a WARC record header that stops before the blank line
    ending it: a record cut short inside its header."""
    if not content or b"\r\n\r\n" in content or b"\n\n" in content:
        return False
    first, newline, _ = content.partition(b"\n")
    return VERSION_LINE.match(content) is not None if newline else VERSION_PREFIX.fullmatch(first) is not None


def _header_cut_short(path: Path, offset: int, gz: bool) -> bool:
    """Whether the record at byte ``offset`` (where its gzip member begins, in a .warc.gz) is cut
    short inside its header, by the end of the file or of its gzip member."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(1 << 16)
    if gz:
        d = zlib.decompressobj(wbits=31)
        try:
            data = d.decompress(data, 1 << 16)
        except zlib.error:
            return False  # a damaged member: reported as such
        if not d.eof and len(data) >= 1 << 16:
            return False
    return cut_header(data)


def _cut_header_tail(path: Path, offset: int, length: str | None) -> int | None:
    """Where an uncompressed WARC ends inside a record header after the record at byte ``offset``
    (whose Content-Length header is ``length``), or None. fastwarc raises at a header cut inside
    its version line; it is the end of a truncated file, not damage in the middle."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(1 << 16)
        if cut_header(data):  # the record at ``offset`` itself
            return offset
        block = re.search(rb"\r?\n\r?\n", data)
        if block is None or length is None or not length.strip().isdigit():
            return None
        end = offset + block.end() + int(length)
        f.seek(end)
        tail = f.read(1 << 16)
    skipped = len(tail) - len(tail.lstrip(b"\r\n"))
    return end + skipped if cut_header(tail[skipped:]) else None


def _blank_from(f: BinaryIO, position: int, chars: bytes | None = None) -> bool:
    """Whether the file holds nothing but ``chars`` (``bytes.strip``'s argument: None is
    whitespace, NUL bytes are padding) from ``position`` on."""
    f.seek(position)
    while chunk := f.read(1 << 20):
        if chunk.strip(chars):
            return False
    return True


def _next_warc_member(path: Path, start: int) -> int | None:
    """Where the first whole gzip member holding a WARC record begins at or after byte ``start``, if any."""
    warc = ".warc" in path.name.lower()
    block = 1 << 20
    with open(path, "rb") as f:
        position = start
        while True:
            f.seek(position)
            data = f.read(block + len(GZIP_MAGIC) - 1)
            if len(data) < len(GZIP_MAGIC):
                return None
            at = data.find(GZIP_MAGIC)
            while at != -1:
                _, head, problem = _read_gzip_member(f, position + at)
                if problem is None and (head.startswith(b"WARC/") or not warc):
                    return position + at
                at = data.find(GZIP_MAGIC, at + 1)
            position += block


def _damaged_tail(path: Path, last_offset: int | None, origin: int = 0) -> tuple[int, str] | None:
    """(offset, reason) when an uncompressed WARC read from ``origin`` holds bytes but no record."""
    if last_offset is not None:
        return None
    with open(path, "rb") as f:
        if not _blank_from(f, origin):
            return origin, "truncated-record: no WARC record could be parsed"
    return None


def _warc_resumes_at(path: Path, offset: int, record_id: str | None) -> bool:
    """Whether parsing from byte ``offset`` starts with the record counted there.

    True for an uncompressed WARC and for a .warc.gz written one gzip member per record (the
    standard layout). Inside a gzip member holding several records, fastwarc's ``stream_pos``
    is only how far its decompressor had got, and such a piece is read from the file's top.
    """
    from fastwarc.warc import ArchiveIterator

    if record_id is None:
        return False
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            record = next(iter(ArchiveIterator(f, parse_http=False)), None)
            return record is not None and record.stream_pos == offset and record.record_id == record_id
    except OSError:
        return False


BOMS = ((b"\xef\xbb\xbf", "utf-8"), (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))
CHARSET_PARAM = re.compile(r"""charset\s*=\s*["']?\s*([\w.:+-]+)""", re.IGNORECASE)
META_CHARSET = re.compile(rb"""<meta\s[^>]*?charset\s*=\s*["']?\s*([\w.:+-]+)""", re.IGNORECASE)
META_SCAN_BYTES = 2048  # the HTML standard wants the declaration in the first 1024; pages often put it a little later


def _whatwg_windows_1252(exc: UnicodeError) -> tuple[str, int]:
    """Decode error handler for cp1252 alone: the five bytes Python's cp1252 leaves undefined (0x81,
    0x8D, 0x8F, 0x90, 0x9D) are the C1 controls U+0081... in the WHATWG windows-1252 browsers use."""
    if isinstance(exc, UnicodeDecodeError) and exc.object[exc.start] in b"\x81\x8d\x8f\x90\x9d":
        return chr(exc.object[exc.start]), exc.start + 1
    raise exc


codecs.register_error("lmforge-whatwg-1252", _whatwg_windows_1252)


@lru_cache(maxsize=512)
def charset_codec(label: str) -> str | None:
    """The Python codec for a charset label, read as browsers read it (the WHATWG Encoding Standard);
    None for a label that names no encoding a browser knows.

    Mapping labels rather than passing them to ``bytes.decode`` matters: ISO-8859-1, latin-1 and
    US-ASCII pages are windows-1252 (smart quotes in 0x80-0x9F), GB2312 is GBK, and Python-only
    codecs (``utf-7``, ``unicode_escape``, ``rot13``) are not charsets of a web page at all.
    """
    from resiliparse.parse.encoding import map_encoding_to_html5

    label = label.strip("\"' ")
    codec = map_encoding_to_html5(label, fallback_utf8=False)
    if codec is None:  # a Python spelling of a known encoding: latin-1, iso_8859_15, cp936...
        try:
            codec = map_encoding_to_html5(codecs.lookup(label).name, fallback_utf8=False)
        except (LookupError, ValueError):
            return None
    return codec


def decode_payload(payload: bytes, declared: str | None = None, html: bool = False) -> tuple[str | None, str, str]:
    """(text, codec, which rule chose it) in the first charset that decodes all the payload strictly,
    or (None, "", the problem). The rules, in order:

    1. a byte order mark;
    2. UTF-8, if the payload is valid UTF-8 and not plain ASCII: text in a legacy charset
       practically never is, so a label saying otherwise is wrong (a server's default ISO-8859-1
       header on a UTF-8 page); datatrove and trafilatura also try UTF-8 before anything else;
    3. the HTTP header's charset (``declared``);
    4. for HTML, a ``<meta charset>`` or ``<meta http-equiv="Content-Type">`` in the first 2 KB;
    5. UTF-8.

    Nothing is guessed: a page that declares no charset that decodes it and is not UTF-8 is a
    reject naming each charset tried (datatrove would ask cchardet, whose guess from a short page
    is often wrong, and wrong text passes the filters unseen). A UTF-16 label is believed only for
    a payload with NUL bytes; NUL bytes otherwise mean a binary payload.
    The rules are named bom, valid-utf-8, http-header, html-meta and default.
    """
    if payload[:1] in (b"\xef", b"\xff", b"\xfe"):
        for bom, codec in BOMS:
            if payload.startswith(bom):
                try:
                    return payload[len(bom):].decode(codec), codec, "bom"
                except UnicodeDecodeError:
                    break  # a stray BOM-like start: the other rules decide
    nul = payload.find(b"\0", 0, 4096) != -1
    header_codec = charset_codec(declared) if declared else None
    failures: dict[str, tuple[str, list[str]]] = {}  # codec (or unknown label) -> (why it failed, as what)
    if not nul and (header_codec == "utf-8" or not payload.isascii()):  # steps 2 and 3 for most pages, at once
        try:
            return payload.decode("utf-8"), "utf-8", "http-header" if header_codec == "utf-8" else "valid-utf-8"
        except UnicodeDecodeError as exc:
            failures["utf-8"] = (f"invalid utf-8 at byte {exc.start}", ["valid-utf-8"])

    def attempt(codec: str | None, source: str, label: str = "") -> tuple[str, str, str] | None:
        if codec is None:
            failures.setdefault(label, (f"unknown charset {label!r}", []))[1].append(source)
        elif codec.startswith("utf-16") and not nul:
            failures.setdefault(codec, (f"{codec} without NUL bytes", []))[1].append(source)
        elif codec in failures:
            failures[codec][1].append(source)
        else:
            try:
                errors = "lmforge-whatwg-1252" if codec == "cp1252" else "strict"
                return payload.decode(codec, errors=errors), codec, source
            except UnicodeDecodeError as exc:
                failures[codec] = (f"invalid {codec} at byte {exc.start}", [source])
        return None

    if nul:  # text with NUL bytes is UTF-16 (said so by the header) or not text at all
        found = attempt(header_codec, "http-header") if header_codec and header_codec.startswith("utf-16") else None
        return found or (None, "", "binary-payload: NUL bytes in the payload")
    if declared and (found := attempt(header_codec, "http-header", declared)):
        return found
    if html and (m := META_CHARSET.search(payload, 0, META_SCAN_BYTES)):
        label = m.group(1).decode("ascii")
        codec = charset_codec(label)
        # a <meta> readable as ASCII is not in UTF-16; browsers take such a declaration to mean UTF-8
        if found := attempt("utf-8" if codec and codec.startswith("utf-16") else codec, "html-meta", label):
            return found
    if found := attempt("utf-8", "default"):
        return found
    return None, "", "undecodable-payload: " + "; ".join(f"{why} ({', '.join(sources)})"
                                                        for why, sources in failures.values())


def read_warc(path: Path, cfg: InputsConfig, start: int, stop: int,
              offset: int | None = None) -> Iterator[tuple[Document, str | None]]:
    """Kept records ``[start, stop)``; with ``offset`` (where record ``start`` begins) parsing starts there."""
    for index, item in enumerate(_warc_records(path, cfg, offset or 0), start=0 if offset is None else start):
        if index < start:
            continue
        if index >= stop:
            break
        rec = item.record
        if rec is None:
            doc = Document(id=f"{path}@{item.offset}", text="", metadata={"source": str(path), "offset": item.offset})
            yield doc, item.problem
            continue
        url = rec.headers.get("WARC-Target-URI", "")
        record_id = (rec.record_id or f"{path}@{item.offset}").strip("<>")
        ctype = rec.headers.get("WARC-Identified-Payload-Type") or (rec.http_content_type if rec.is_http else None) \
            or rec.headers.get("Content-Type", "")
        meta = {"url": url, "source": str(path), "offset": item.offset, "content_type": ctype.split(";")[0].strip()}
        if rec.is_http and rec.http_headers is not None:
            meta["http_status"] = rec.http_headers.status_code
        if item.problem:
            yield Document(record_id, item.payload.decode("utf-8", "replace"), meta), item.problem
            continue
        if rec.is_http:  # the charset the server declared
            declared = rec.http_charset
        else:  # a resource or conversion record's own Content-Type
            m = CHARSET_PARAM.search(rec.headers.get("Content-Type", ""))
            declared = m and m.group(1)
        html = not meta["content_type"] or meta["content_type"].lower() in HTML_TYPES
        yield _decoded_document(record_id, item.payload, meta, declared, html)


def _decoded_document(doc_id: str, data: bytes, meta: dict[str, Any], declared: str | None, html: bool
                      ) -> tuple[Document, str | None]:
    """The document of a payload as ``decode_payload(data, declared, html)`` reads it; a reject,
    with U+FFFD for what is not UTF-8, if it could not.

    Text read in a charset other than UTF-8 names it and the rule that chose it in the metadata.
    """
    text, charset, note = decode_payload(data, declared, html)
    if text is None:
        return Document(doc_id, data.decode("utf-8", "replace"), meta), note
    if charset != "utf-8":
        meta["charset"], meta["charset_source"] = charset, note
    return Document(doc_id, text, meta), None


# --------------------------------------------------------------------------- other formats


def read_whole_file(path: Path, fmt: str) -> Iterator[tuple[Document, str | None]]:
    """An HTML or text file is one document; its id and url are its path."""
    try:
        with open_binary(path) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"{path}: {unreadable(exc)}") from exc
    meta: dict[str, Any] = {"source": str(path)}
    if fmt == "html":
        meta.update(url=path.as_posix(), content_type="text/html")
    yield _decoded_document(str(path), data, meta, None, fmt == "html")


def read_jsonl(path: Path, cfg: InputsConfig, start: int, stop: int,
               offset: int | None = None) -> Iterator[tuple[Document, str | None]]:
    """Each JSON line is a document; fields other than text and id become metadata.

    Lines ``[start, stop)`` are read; ``offset`` is where line ``start`` begins in the (decompressed) text.
    """
    lines = jsonl_lines(path, start, offset)
    lineno = start
    while True:
        try:
            lineno, raw = next(lines)
        except StopIteration:
            return
        except DamagedFile as exc:
            doc = Document(f"{path.name}:damaged", "", {"source": str(path)})
            yield doc, f"unreadable-file: {exc}"
            return
        if lineno > stop:
            return
        record = parse_jsonl_line(raw)
        if record is BLANK:
            continue
        where = f"{path}:{lineno}"
        fallback_id = f"{path.name}:{lineno}"
        if isinstance(record, BadRecord):
            yield Document(fallback_id, "", {"source": str(path)}), f"{record.reason.replace('_', '-')}: {where}: {record.detail}"
            continue
        if not isinstance(record, dict):
            yield Document(fallback_id, "", {"source": str(path)}), f"not-an-object: {where}: {type(record).__name__}"
            continue
        problem = lone_surrogate(record) if b"\\u" in raw else None  # only a JSON \u escape makes one
        if problem:
            doc, _ = _record_document(replace_surrogates(record), cfg, fallback_id, path, where)
            yield doc, f"invalid-unicode: {where}: {problem}"
            continue
        yield _record_document(record, cfg, fallback_id, path, where)


def _record_document(record: dict, cfg: InputsConfig, fallback_id: str, path: Path, where: str
                     ) -> tuple[Document, str | None]:
    text = record.get(cfg.text_field)
    doc_id = record.get(cfg.id_field)
    meta = {k: v for k, v in record.items() if k not in (cfg.text_field, cfg.id_field)}
    meta.setdefault("source", str(path))
    doc = Document(str(doc_id) if doc_id is not None else fallback_id, text if isinstance(text, str) else "", meta)
    if text is None:
        return doc, f"missing-text: {where}: no {cfg.text_field!r} field"
    if not isinstance(text, str):
        return doc, f"text-not-string: {where}: {cfg.text_field!r} is {type(text).__name__}"
    return doc, None


def read_parquet(path: Path, cfg: InputsConfig, start: int, stop: int) -> Iterator[tuple[Document, str | None]]:
    """Rows ``[start, stop)``; damage partway is one reject for the rows that could not be read."""
    pf = open_parquet(path)
    if cfg.text_field not in pf.schema_arrow.names:
        raise InputError(f"{path}: no {cfg.text_field!r} column (columns: {pf.schema_arrow.names})")
    try:
        yield from _parquet_records(path, pf, cfg, start, stop)
    except DamagedFile as exc:
        yield Document(f"{path.name}:damaged", "", {"source": str(path)}), f"unreadable-file: {exc}"


def _parquet_records(path: Path, pf: Any, cfg: InputsConfig, start: int, stop: int
                     ) -> Iterator[tuple[Document, str | None]]:
    row = 0
    for batch in parquet_batches(pf, path):
        if row + batch.num_rows <= start:
            row += batch.num_rows
            continue
        for record, problem in parquet_rows(batch):
            if start <= row < stop:
                fallback_id, where = f"{path.name}:{row + 1}", f"{path}:row {row + 1}"
                doc, reason = _record_document(record, cfg, fallback_id, path, where)
                yield doc, f"invalid-utf8: {where}: {problem}" if problem else reason
            row += 1
            if row >= stop:
                return
