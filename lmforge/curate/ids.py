"""Unique output ids: how repeated input ids are renamed.

Output ids are unique. A document keeps its input id unless a document before it in input
order (all inputs, kept or rejected) has the same id; then its id becomes
"<id>@<source>#<n>": the file it was read from, and its place among the documents read from
that file (counting from 1). So the first holder of an id keeps it, and ids depend on the
inputs alone, not on the steps or the sharding. (Unique unless an input id already has that
form.) datatrove passes its readers' ids through, repeated or not; here every id names one
document, as the dedup reasons ("exact-duplicate of <id>"), clusters and the report need.

Segment 0 hashes each shard's ids into exact_dedup's bucket files (work/seg-0/ids/), the
buckets are resolved in parallel (the first (shard, position) of each hash wins; two ids
sharing a 64-bit hash would only cost one an unneeded suffix), and the repeats are renamed
when segment 0's documents are read back, so no process holds all ids.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from lmforge.core.io import atomic_write_bytes, atomic_write_json, atomic_write_npy
from lmforge.curate.plan import Job, seg_dir
from lmforge.curate.records import read_docs, read_records
from lmforge.data.documents import Document

ID_BUCKETS = 8


def _ids_dir(job: Job) -> Path:
    return seg_dir(job, 0) / "ids"


def index_ids(job: Job, shard: int, ids: list[str], kept_mask: list[bool]) -> None:
    """Write the shard's id hashes (by reading position) and which documents segment 0 kept."""
    import numpy as np
    import xxhash

    from lmforge.curate.exact_dedup import ROW, write_rows

    rows = np.array([(xxhash.xxh3_64_intdigest(i.encode()), p, 0) for p, i in enumerate(ids)], dtype=ROW)
    write_rows(_ids_dir(job), shard, rows, ID_BUCKETS)
    atomic_write_npy(_ids_dir(job) / "kept" / f"s{shard:06d}.npy", np.array(kept_mask, dtype=bool))


def resolve_ids(job: Job, results: list[dict], pool: Any) -> bool:
    """Find the repeated ids, and where each piece's documents start among its file's; True if
    an earlier run had done it."""
    from lmforge.curate.exact_dedup import resolve_bucket

    done = _ids_dir(job) / "resolve.done"
    if done.exists():
        return True
    pool(partial(resolve_bucket, _ids_dir(job), len(job.shards)), list(range(ID_BUCKETS)))
    read_before: Counter = Counter()  # documents read from each file in earlier pieces
    for shard, (pieces, result) in enumerate(zip(job.shards, results)):
        starts = []
        for piece, n in zip(pieces, result["piece_docs"]):
            starts.append(read_before[piece.path])
            read_before[piece.path] += n
        atomic_write_json(_ids_dir(job) / "starts" / f"s{shard:06d}.json", starts)
    atomic_write_bytes(done, b"")
    return False


def _id_suffixes(job: Job, shard: int, kept: bool) -> list[str] | None:
    """What to append to the id of each document segment 0 kept (or rejected) of ``shard``, in
    file order: "" or "@<source>#<n>"; None when none of the shard's ids is a repeat."""
    import numpy as np

    from lmforge.curate.exact_dedup import read_repeats

    ids_dir = _ids_dir(job)
    repeats = read_repeats(ids_dir, shard)["doc"]
    if not len(repeats):
        return None
    counts = json.loads((seg_dir(job, 0) / f"shard-{shard:06d}.done.json").read_text())["piece_docs"]
    starts = json.loads((ids_dir / "starts" / f"s{shard:06d}.json").read_text())
    ends = np.cumsum(counts)  # reading position where each piece's documents end
    suffix = {}
    for position in repeats.tolist():
        piece = int(np.searchsorted(ends, position, side="right"))
        n = starts[piece] + position - (int(ends[piece]) - counts[piece]) + 1
        suffix[position] = f"@{job.shards[shard][piece].path}#{n}"
    kept_mask = np.load(ids_dir / "kept" / f"s{shard:06d}.npy")
    return [suffix.get(p, "") for p in np.flatnonzero(kept_mask == kept).tolist()]


def segment_docs(job: Job, seg: int, shard: int) -> list[Document]:
    """The documents segment ``seg`` kept of ``shard``, with unique ids."""
    docs = read_docs(seg_dir(job, seg) / f"shard-{shard:06d}.kept.jsonl")
    if seg == 0 and (suffixes := _id_suffixes(job, shard, kept=True)) is not None:
        for doc, suffix in zip(docs, suffixes, strict=True):
            doc.id += suffix
    return docs


def segment_rejects(job: Job, seg: int, shard: int) -> Iterator[dict]:
    """The reject records segment ``seg`` wrote for ``shard``, with unique ids."""
    records = read_records(seg_dir(job, seg) / f"shard-{shard:06d}.rejects.jsonl")
    suffixes = _id_suffixes(job, shard, kept=False) if seg == 0 else None
    if suffixes is None:
        yield from records
        return
    for record, suffix in zip(records, suffixes, strict=True):
        record["id"] += suffix
        yield record
