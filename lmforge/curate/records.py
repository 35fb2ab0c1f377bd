"""The files of a curation run's documents: JSON lines written atomically, kept and reject
records, the output shards (Parquet or JSONL) and reading a finished run's outputs back.

    output/shard-00000.parquet    id, text, metadata (JSON)   -- what `lmforge prepare` reads
    rejects/shard-00000.jsonl     id, text, metadata, stage, reason
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmforge.core.io import atomic_write_bytes, temporary_file
from lmforge.data.documents import Document


class JsonlWriter:
    """Write JSON lines to a temporary file that replaces ``path`` on ``commit``."""

    def __init__(self, path: Path):
        self.path = path
        fd, self.tmp = temporary_file(path)
        self.f = os.fdopen(fd, "w", encoding="utf-8")
        self.count = 0

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        Path(self.tmp).unlink(missing_ok=True)


def doc_record(doc: Document) -> dict:
    return {"id": doc.id, "text": doc.text, "metadata": doc.metadata}


def reject_record(doc: Document, stage: str, reason: str) -> dict:
    return {"id": doc.id, "text": doc.text, "metadata": doc.metadata, "stage": stage, "reason": reason}


def read_records(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def read_docs(path: Path) -> list[Document]:
    return [Document(r["id"], r["text"], r["metadata"]) for r in read_records(path)]


def write_output(path: Path, docs: list[Document], fmt: str) -> None:
    if fmt == "jsonl":
        data = "".join(json.dumps(doc_record(d), ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": pa.array([d.id for d in docs], pa.string()),
                          "text": pa.array([d.text for d in docs], pa.string()),
                          "metadata": pa.array([json.dumps(d.metadata, ensure_ascii=False) for d in docs], pa.string())})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        data = buf.getvalue()
    atomic_write_bytes(path, data)


def iter_run_records(run_dir: Path) -> Iterable[tuple[dict, str | None, str | None]]:
    """(metadata-bearing record, stage, reason) of every document in a finished run's outputs."""
    import pyarrow.parquet as pq

    for path in sorted((run_dir / "output").glob("shard-*")):
        if path.suffix == ".parquet":
            table = pq.read_table(path, columns=["id", "metadata"]).to_pylist()
            for row in table:
                yield {"id": row["id"], "metadata": json.loads(row["metadata"])}, None, None
        else:
            for r in read_records(path):
                yield r, None, None
    for path in sorted((run_dir / "rejects").glob("shard-*.jsonl")):
        for r in read_records(path):
            yield r, r["stage"], r["reason"]
