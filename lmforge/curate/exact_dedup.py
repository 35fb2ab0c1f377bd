"""Exact deduplication of documents, lines or paragraphs across the whole corpus.

A CorpusStep in three phases (see ``base.py``):

1. ``index_shard``: hash every unit (the stripped document text, or each non-blank line or
   paragraph) with 64-bit xxh3 and write ``(hash, doc, unit)`` rows into one file per hash
   bucket, so no process ever holds the whole corpus's hashes.
2. ``resolve``: one task per bucket (through ``pool_map``) sorts its rows by
   ``(hash, shard, doc, unit)``; the first row of each hash is the original, every later
   row a duplicate, written to a per-shard list together with where its original is.
3. ``apply_shard``: a duplicate document is rejected as ``exact-duplicate of <id>``; a
   duplicate line or paragraph is removed from its document, and a document left with
   nothing is rejected.

The first occurrence in (shard, position) order wins, as datatrove's ``ExactDedup`` keeps
its first document of equal priority. ``write_rows``, ``resolve_bucket`` and ``read_repeats``
find first occurrences of any 64-bit key; the pipeline uses them on document ids too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash

from lmforge.core.config import at_least, check_ranges, option, positive
from lmforge.core.io import atomic_write_npy, atomic_write_text
from lmforge.curate.base import PoolMap
from lmforge.data.documents import Document

ROW = np.dtype([("hash", "<u8"), ("doc", "<u4"), ("unit", "<u4")])
DUP = np.dtype([("doc", "<u4"), ("unit", "<u4"), ("first_shard", "<u4"), ("first_doc", "<u4")])
_PARAGRAPHS = re.compile(r"(\n\s*\n)")


@dataclass
class ExactDedupConfig:
    """Exact duplicates across the corpus (64-bit xxh3 of each unit); the first in (shard, position)
    order is kept."""

    unit: Literal["document", "line", "paragraph"] = option(
        "document",
        help="document: reject a document whose text repeats an earlier one's; line, paragraph: remove repeated "
        "lines or paragraphs from documents (a document left with nothing is rejected)",
    )
    lowercase: bool = option(False, help="hash lowercased text (whitespace at the ends is always stripped)")
    min_chars: int = at_least(0, 0, help="line, paragraph: units shorter than this many characters are never removed")
    num_buckets: int = positive(
        16, help="hash-range buckets, resolved in parallel, so that no process holds the whole corpus's hashes"
    )

    def __post_init__(self) -> None:
        check_ranges(self, "exact_dedup.")  # built in Python too


def split_units(text: str, unit: str) -> list[str]:
    """Lines, or paragraphs with their separators between them (so joining gives the text back)."""
    return text.split("\n") if unit == "line" else _PARAGRAPHS.split(text)


def _hash(text: str, lowercase: bool) -> int:
    text = text.strip()
    return xxhash.xxh3_64_intdigest((text.lower() if lowercase else text).encode("utf-8"))


class ExactDedup:
    def __init__(self, cfg: ExactDedupConfig):
        self.cfg = cfg
        self.name = "exact_dedup" if cfg.unit == "document" else f"exact_{cfg.unit}_dedup"

    def _units(self, doc: Document) -> list[tuple[int, str]]:
        if self.cfg.unit == "document":
            return [(0, doc.text)]
        parts = split_units(doc.text, self.cfg.unit)
        step = 1 if self.cfg.unit == "line" else 2  # paragraphs sit at even positions
        return [(i, parts[i]) for i in range(0, len(parts), step)
                if parts[i].strip() and len(parts[i].strip()) >= self.cfg.min_chars]

    def index_shard(self, shard: int, docs: list[Document], work_dir: Path) -> None:
        rows = [(_hash(text, self.cfg.lowercase), d, u) for d, doc in enumerate(docs) for u, text in self._units(doc)]
        write_rows(work_dir, shard, np.array(rows, dtype=ROW), self.cfg.num_buckets)
        if self.cfg.unit == "document":
            atomic_write_text(work_dir / "ids" / f"s{shard:06d}.json", json.dumps([d.id for d in docs]))

    def resolve(self, work_dir: Path, num_shards: int, pool_map: PoolMap) -> None:
        pool_map(partial(resolve_bucket, work_dir, num_shards), list(range(self.cfg.num_buckets)))

    def apply_shard(self, shard: int, docs: list[Document], work_dir: Path) -> list[str | None]:
        dup = read_repeats(work_dir, shard)
        decisions: list[str | None] = [None] * len(docs)
        if self.cfg.unit == "document":
            ids: dict[int, list[str]] = {}
            for row in dup:
                first_shard = int(row["first_shard"])
                if first_shard not in ids:
                    ids[first_shard] = json.loads((work_dir / "ids" / f"s{first_shard:06d}.json").read_text())
                decisions[row["doc"]] = f"exact-duplicate of {ids[first_shard][row['first_doc']]}"
            return decisions
        drop: dict[int, set[int]] = {}
        for row in dup:
            drop.setdefault(int(row["doc"]), set()).add(int(row["unit"]))
        for d, units in drop.items():
            doc = docs[d]
            parts = split_units(doc.text, self.cfg.unit)
            kept = [p for i, p in enumerate(parts) if i not in units]
            text = "\n".join(kept) if self.cfg.unit == "line" else "".join(kept)
            text = re.sub(r"\n{3,}", "\n\n", text).strip()
            doc.metadata[f"removed_{self.cfg.unit}s"] = len(units)
            if not text:
                decisions[d] = f"all-{self.cfg.unit}s-duplicate: {len(units)} {self.cfg.unit}s seen earlier"
            else:
                doc.text = text
        return decisions


def write_rows(work_dir: Path, shard: int, rows: np.ndarray, num_buckets: int) -> None:
    """Phase 1's output: the shard's ``ROW`` rows, one file per hash bucket."""
    buckets = rows["hash"] % num_buckets
    for b in range(num_buckets):
        atomic_write_npy(work_dir / "index" / f"b{b:04d}" / f"s{shard:06d}.npy", rows[buckets == b])


def read_repeats(work_dir: Path, shard: int) -> np.ndarray:
    """Phase 2's output for one shard: a ``DUP`` row for each of its rows whose hash an earlier row had."""
    dups = [np.load(p) for p in sorted((work_dir / "dups").glob(f"b*/s{shard:06d}.npy"))]
    return np.concatenate(dups) if dups else np.zeros(0, DUP)


def resolve_bucket(work_dir: Path, num_shards: int, bucket: int) -> int:
    """Mark every row of one bucket whose hash appeared earlier; returns the number of duplicates."""
    parts, shards = [], []
    for s in range(num_shards):
        path = work_dir / "index" / f"b{bucket:04d}" / f"s{s:06d}.npy"
        if path.exists():
            rows = np.load(path)
            parts.append(rows)
            shards.append(np.full(len(rows), s, dtype="<u4"))
    rows = np.concatenate(parts) if parts else np.zeros(0, ROW)
    shard = np.concatenate(shards) if shards else np.zeros(0, "<u4")
    order = np.lexsort((rows["unit"], rows["doc"], shard, rows["hash"]))
    rows, shard = rows[order], shard[order]
    first = np.ones(len(rows), dtype=bool)
    first[1:] = rows["hash"][1:] != rows["hash"][:-1]
    origin = np.maximum.accumulate(np.where(first, np.arange(len(rows)), 0))  # index of each hash's first row
    dup = ~first
    out = np.zeros(int(dup.sum()), DUP)
    out["doc"], out["unit"] = rows["doc"][dup], rows["unit"][dup]
    out["first_shard"], out["first_doc"] = shard[origin][dup], rows["doc"][origin][dup]
    dup_shard = shard[dup]
    for s in range(num_shards):
        atomic_write_npy(work_dir / "dups" / f"b{bucket:04d}" / f"s{s:06d}.npy", out[dup_shard == s])
    return len(out)
