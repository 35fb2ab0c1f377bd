"""Read documents from JSONL, Parquet and plain-text files.

Every reader yields a ``Document`` (id, text, and ``metadata["source"]``, the file it came from). A bad record (malformed JSON, invalid
UTF-8, a missing or non-string text field) is an ``InputError`` naming the file and line,
or, with ``skip_bad_records``, is skipped and counted in a ``SkipLog`` so that nothing is
dropped without a trace.

With ``messages_field`` set, JSONL and Parquet records hold conversations (TRL's ``messages``)
instead of text: each becomes one document, its turns rendered in ChatML as ``lmforge sft``
renders them (``data.chatml.chatml_text``), every token of it trained by pre-training. That is
mid-training on chat data: the model sees the format and the tasks before fine-tuning.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
import zlib
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import IO, Any

from lmforge.core.config import option
from lmforge.core.io import InputError, expand_paths
from lmforge.data.chatml import ExampleError, chatml_text, validate_messages

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class DocumentsConfig:
    """Where documents come from and how to read them."""

    paths: list[str] = option(default_factory=list, help="files or glob patterns (``**`` allowed)")
    text_field: str = option("text", help="JSONL key / Parquet column holding the text")
    id_field: str = option("id", help="optional; missing ids become ``<file>:<line>``")
    messages_field: str | None = option(
        None, help="a key / column of TRL `messages`: each conversation read as its ChatML text"
    )
    skip_bad_records: bool = option(False, help="count and skip bad records instead of stopping")
    score_field: str | None = option(
        None,
        help="a numeric field of every record kept as the document's score (dotted into objects and JSON strings: "
        "metadata.classifier_score, what `lmforge curate` writes), which pretrain's data.score_order orders by",
    )

    @property
    def read_field(self) -> str:
        """The key / column each record's document comes from."""
        return self.messages_field or self.text_field


@dataclass
class Document:
    """One document, as the readers here and the curation pipeline (``lmforge.curate``) pass it on."""

    id: str  # the JSONL/Parquet id, ``<file>:<line>``, a file name, or a WARC record id
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)  # source (the file), url, language, scores, cluster, ...

    @property
    def source(self) -> str:
        """The file the document was read from (empty if none is known)."""
        return self.metadata.get("source", "")


@dataclass
class SkipLog:
    """Counts of records set aside, by reason, with the first few locations as examples."""

    by_reason: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 20

    def add(self, reason: str, where: str, detail: str) -> None:
        self.by_reason[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(f"{where}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def to_dict(self) -> dict:
        return {"total": self.total, "by_reason": dict(sorted(self.by_reason.items())), "examples": self.examples}


def file_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def read_documents(cfg: DocumentsConfig, skipped: SkipLog | None = None) -> Iterator[Document]:
    """Yield the documents of every configured file, in configured order."""
    skipped = skipped if skipped is not None else SkipLog()
    for path in expand_paths(cfg.paths, what="document"):
        yield from read_file(path, cfg, skipped)


def read_file(path: Path, cfg: DocumentsConfig, skipped: SkipLog) -> Iterator[Document]:
    fmt = file_format(path)
    if fmt == "jsonl":
        yield from _read_jsonl(path, cfg, skipped)
    elif fmt == "parquet":
        yield from _read_parquet(path, cfg, skipped)
    elif cfg.messages_field is not None:
        raise InputError(f"{path}: data.messages_field={cfg.messages_field!r} reads conversations from JSONL or "
                         "Parquet records; a plain-text file holds none")
    else:
        yield from _read_text(path, cfg, skipped)


def _bad(cfg: DocumentsConfig, skipped: SkipLog, reason: str, where: str, detail: str) -> None:
    if not cfg.skip_bad_records:
        raise InputError(f"{where}: {detail} (set data.skip_bad_records=true to skip and count such records)")
    skipped.add(reason, where, detail)


def record_score(record: dict, key: str) -> float | str:
    """The number at dotted ``key`` of ``record`` (a JSON string on the way, as a Parquet metadata
    column holds, is parsed), or why there is none."""
    value: Any = record
    for part in key.split("."):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return f"{part!r} of data.score_field {key!r} is inside a string that is not JSON"
        if not isinstance(value, dict) or part not in value:
            return f"no score {key!r} (data.score_field): {part!r} is missing"
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"score {key!r} (data.score_field) is {value!r}, not a finite number"
    return float(value)


def _with_score(doc: Document, record: dict, where: str, cfg: DocumentsConfig, skipped: SkipLog) -> Document | None:
    """``doc`` with ``metadata["score"]`` from ``cfg.score_field`` when one is asked for; None
    (reported or counted) when the record has no such number."""
    if cfg.score_field is None:
        return doc
    score = record_score(record, cfg.score_field)
    if isinstance(score, str):
        _bad(cfg, skipped, "missing_score", where, score)
        return None
    doc.metadata["score"] = score
    return doc


def _record_text(value: object, missing: str, where: str, cfg: DocumentsConfig, skipped: SkipLog) -> str | None:
    """The document text of a record's field: the text itself, or with ``messages_field`` the
    conversation's ChatML; None (reported or counted) when the record is unusable."""
    if cfg.messages_field is None:
        return value if _usable_text(value, missing, where, cfg, skipped) else None
    if value is None:
        _bad(cfg, skipped, "missing_messages", where, missing)
        return None
    try:
        validate_messages(value, cfg.messages_field, need_assistant=False)
    except ExampleError as exc:
        _bad(cfg, skipped, exc.reason, where, str(exc))
        return None
    return chatml_text(value)


def _usable_text(text: object, missing: str, where: str, cfg: DocumentsConfig, skipped: SkipLog) -> bool:
    """True for a non-empty string; otherwise report (or count) why the record is unusable."""
    if text is None:
        _bad(cfg, skipped, "missing_text", where, missing)
    elif not isinstance(text, str):
        _bad(cfg, skipped, "text_not_string", where, f"{cfg.text_field!r} is {type(text).__name__}, not a string")
    elif not text:
        skipped.add("empty_text", where, "empty text")
    else:
        return True
    return False


class DamagedFile(InputError):
    """A file that cannot be read past line ``line - 1``: a gzip file cut short or damaged, a file
    named ``.gz`` that is not gzip, a read error. ``detail`` says which."""

    def __init__(self, path: Path, line: int | str, detail: str):  # a line number, or "row N" of a table
        super().__init__(f"{path}:{line}: {detail}")
        self.line, self.detail = line, detail


def unreadable(exc: BaseException) -> str:
    """Why reading a (possibly gzipped) file stopped, in words: what ``EOFError``, ``BadGzipFile``,
    ``zlib.error`` and ``OSError`` mean to the user."""
    if isinstance(exc, EOFError):
        return "the compressed data is cut short (the file ends inside it); the rest of the file cannot be read"
    if isinstance(exc, gzip.BadGzipFile) and str(exc).startswith("Not a gzipped file"):
        return "not a gzip file, though its name ends in .gz"
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):
        return f"damaged gzip data ({exc}); the rest of the file cannot be read"
    return f"cannot read: {getattr(exc, 'strerror', None) or exc}"


def open_binary(path: Path) -> IO[bytes]:
    try:
        return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror or exc}") from exc


@dataclass
class BadRecord:
    """A JSONL line that is not valid UTF-8 JSON: the reason (for counting) and a message."""

    reason: str
    detail: str


def jsonl_lines(path: Path, start: int = 0, offset: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw line) for the lines after the first ``start``.

    A UTF-8 byte-order mark opening the file (as some Windows editors write) is dropped.
    ``offset``, when known, is where line ``start + 1`` begins in the (decompressed) text: a
    plain file seeks there, a gzip file decompresses and discards what comes before (a pass
    over it, without splitting or parsing lines); without it the first ``start`` lines are
    counted off unparsed.
    """
    lineno = start
    try:
        with open_binary(path) as f:
            if offset is not None:
                f.seek(offset)
            else:
                deque(islice(f, start), maxlen=0)
            for lineno, raw in enumerate(f, start=start + 1):
                yield lineno, raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw
    except (OSError, EOFError, zlib.error) as exc:
        raise DamagedFile(path, lineno + 1, unreadable(exc)) from exc


def jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(file:line, parsed value)`` for every non-blank line; an unparsable line yields a ``BadRecord``,
    and so does the point where a damaged file stops being readable (the last item then)."""
    try:
        for lineno, raw in jsonl_lines(path):
            record = parse_jsonl_line(raw)
            if record is BLANK:
                continue
            if b"\\u" in raw and (problem := lone_surrogate(record)):  # only a JSON \u escape makes one
                record = BadRecord("invalid_unicode", f"{problem}, which no UTF-8 text can hold")
            yield f"{path}:{lineno}", record
    except DamagedFile as exc:
        yield f"{path}:{exc.line}", BadRecord("damaged_file", exc.detail)


BLANK = object()  # what ``parse_jsonl_line`` returns for a blank line

SURROGATE = re.compile("[\ud800-\udfff]")


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def lone_surrogate(record: Any) -> str | None:
    """Where a parsed JSON value holds a lone UTF-16 surrogate (``"\\ud800"`` without its pair), or None.

    Such a string is valid JSON and a valid Python ``str`` but has no UTF-8 encoding, so no
    tokenizer or output file can take it.
    """
    if not isinstance(record, dict):
        return "lone surrogate" if any(SURROGATE.search(s) for s in _strings(record)) else None
    for key, value in record.items():
        if isinstance(value, str) and (m := SURROGATE.search(value)):
            return f"lone surrogate at character {m.start()} of field {key!r}"
        if any(SURROGATE.search(s) for s in _strings({key: value})):
            return f"lone surrogate in field {key!r}"  # repr escapes a surrogate in the key itself
    return None


def replace_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate replaced by U+FFFD, so that it can be written."""
    if isinstance(value, str):
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {replace_surrogates(k): replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_surrogates(v) for v in value]
    return value


class NonFiniteNumber(ValueError):
    """A JSON number that is NaN or infinite (Python's ``json`` reads ``NaN``, ``Infinity`` and ``1e400``)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(text)
    return value


def _no_constant(name: str) -> float:
    raise NonFiniteNumber(name)


def parse_json_text(text: str) -> Any:
    """``json.loads`` that refuses NaN and infinite numbers (``NonFiniteNumber``): strict JSON has
    none, and one in the data (a margin, a score) would poison training steps later, far from its line."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)


MAX_DEPTH = 100  # JSON nesting a record may have: every reader and writer after this one walks it recursively
TOO_DEEP = BadRecord("too_deep", f"JSON nested more than {MAX_DEPTH} levels deep")


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests lists and objects more than ``limit`` levels deep (a walk
    without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def parse_jsonl_line(raw: bytes) -> Any:
    """One JSONL line's value; ``BLANK`` for a blank line; a ``BadRecord`` for invalid UTF-8 or JSON,
    or for a NaN or infinite number."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRecord("invalid_utf8", f"invalid UTF-8 at byte {exc.start} of the line")
    if not line.strip():
        return BLANK
    try:
        value = parse_json_text(line)
    except json.JSONDecodeError as exc:
        # json's message for a control character ends in "at" ("Invalid control character at")
        return BadRecord("malformed_json", f"malformed JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}")
    except NonFiniteNumber as exc:
        return BadRecord("non_finite_number", f"{exc} is not a finite number (JSON data may hold only finite numbers)")
    except RecursionError:  # nested deeper than Python's stack
        return TOO_DEEP
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and nested_deeper(value, MAX_DEPTH):
        return TOO_DEEP
    return value


def _read_jsonl(path: Path, cfg: DocumentsConfig, skipped: SkipLog) -> Iterator[Document]:
    key = cfg.read_field
    for where, record in jsonl_records(path):
        if isinstance(record, BadRecord):
            _bad(cfg, skipped, record.reason, where, record.detail)
            continue
        if not isinstance(record, dict):
            _bad(cfg, skipped, "not_an_object", where, f"expected a JSON object, got {type(record).__name__}")
            continue
        text = _record_text(record.get(key), f"no {key!r} field (keys: {sorted(record)[:8]})", where, cfg, skipped)
        if text is not None:
            doc_id = record.get(cfg.id_field)
            line = where.rsplit(":", 1)[1]
            doc = _with_score(Document(id=str(doc_id) if doc_id is not None else f"{path.name}:{line}",
                                       text=text, metadata={"source": str(path)}), record, where, cfg, skipped)
            if doc is not None:
                yield doc


def parquet_rows(batch: Any) -> list[tuple[dict, str | None]]:
    """The batch's rows with None, or, for a row holding invalid UTF-8 in a string column (Parquet
    writers need not check), the row with U+FFFD in its place and where the bad byte is."""
    try:
        return [(record, None) for record in batch.to_pylist()]
    except UnicodeDecodeError:
        pass
    import pyarrow as pa

    rows: list[tuple[dict, str | None]] = []
    for i in range(batch.num_rows):
        record: dict[str, Any] = {}
        problem = None
        for name, column in zip(batch.schema.names, batch.slice(i, 1).columns):
            try:
                record[name] = column[0].as_py()
            except UnicodeDecodeError as exc:
                if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                    raw = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
                    record[name] = raw[0].as_py().decode("utf-8", "replace")
                else:
                    record[name] = None  # a nested column: no text to show
                problem = problem or f"invalid UTF-8 at byte {exc.start} of column {name!r}"
        rows.append((record, problem))
    return rows


def open_parquet(path: Path) -> Any:
    """A ``pyarrow.parquet.ParquetFile``; a file that is not one is an ``InputError`` naming it."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"{path}: not a readable Parquet file: {exc}") from exc


def parquet_batches(pf: Any, path: Path, columns: list[str] | None = None, batch_size: int = 4096) -> Iterator[Any]:
    """The record batches of an open Parquet file, row group by row group (so that damaged data
    partway loses only what follows it); a page that cannot be decoded is a ``DamagedFile`` naming
    the first row that could not be read."""
    import pyarrow as pa

    row = 0
    batches = (batch for group in range(pf.num_row_groups)
               for batch in pf.iter_batches(columns=columns, batch_size=batch_size, row_groups=[group]))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as exc:
            raise DamagedFile(path, f"row {row + 1}", f"damaged Parquet data ({exc}); the rest of the file "
                                                      "cannot be read") from exc
        row += batch.num_rows
        yield batch


def _read_parquet(path: Path, cfg: DocumentsConfig, skipped: SkipLog) -> Iterator[Document]:
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    key = cfg.read_field
    if key not in names:
        raise InputError(f"{path}: no {key!r} column (columns: {names})")
    columns = [key] + ([cfg.id_field] if cfg.id_field in names else [])
    if cfg.score_field is not None:
        column = cfg.score_field.split(".")[0]
        if column not in names:
            raise InputError(f"{path}: no {column!r} column for data.score_field {cfg.score_field!r} (columns: {names})")
        columns += [column] if column not in columns else []
    try:
        yield from _parquet_documents(path, pf, columns, cfg, skipped)
    except DamagedFile as exc:
        _bad(cfg, skipped, "damaged_file", f"{path}:{exc.line}", exc.detail)


def _parquet_documents(path: Path, pf: Any, columns: list[str], cfg: DocumentsConfig,
                       skipped: SkipLog) -> Iterator[Document]:
    row, key = 0, cfg.read_field
    for batch in parquet_batches(pf, path, columns):
        for record, problem in parquet_rows(batch):
            row += 1
            where = f"{path}:row {row}"
            if problem:
                _bad(cfg, skipped, "invalid_utf8", where, problem)
                continue
            doc_id = record.get(cfg.id_field)
            text = _record_text(record[key], f"{key!r} is null", where, cfg, skipped)
            if text is not None:
                doc = _with_score(Document(id=str(doc_id) if doc_id is not None else f"{path.name}:{row}", text=text,
                                           metadata={"source": str(path)}), record, where, cfg, skipped)
                if doc is not None:
                    yield doc


def _read_text(path: Path, cfg: DocumentsConfig, skipped: SkipLog) -> Iterator[Document]:
    """A plain-text file is one document; its id is the file name."""
    if cfg.score_field is not None:
        raise InputError(f"{path}: a plain-text file has no fields, so no score {cfg.score_field!r} "
                         "(data.score_field): give JSONL or Parquet records with the score, or unset data.score_field")
    try:
        with open_binary(path) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        _bad(cfg, skipped, "damaged_file", str(path), unreadable(exc))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        _bad(cfg, skipped, "invalid_utf8", f"{path}:{line}", f"invalid UTF-8 at byte {exc.start} of the file")
        return
    if not text:
        skipped.add("empty_text", str(path), "empty file")
        return
    yield Document(id=path.name, text=text, metadata={"source": str(path)})


def id_hash(doc_id: str) -> int:
    """A stable 64-bit hash of a document id (blake2b), the same on every machine and run."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "big")


def split_of(doc_id: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"``, from a stable hash of the document id (not of its position)."""
    return "val" if id_hash(doc_id) < val_fraction * 2**64 else "train"
