"""The contract between the curation pipeline and its steps.

A curation run pushes documents (``lmforge.data.documents.Document``: id, text, metadata)
through a list of steps. Input ids may repeat, so steps decide by position; the pipeline makes
output ids unique after segment 0 (``ids.py``). Two kinds of step exist:

* a :class:`DocumentStep` sees one document at a time (extraction, language ID, heuristic
  filters, a score with a fixed threshold). It may annotate ``doc.metadata`` or edit
  ``doc.text``, and returns ``None`` to keep the document or a short reason to reject it.
* a :class:`CorpusStep` needs the whole corpus (exact and MinHash dedup, a percentile cut).
  It runs in three phases so it scales past one shard's memory: ``index_shard`` on every
  shard in parallel (signatures, hashes, scores written under ``work_dir``), ``resolve``
  once (it may fan work out through ``pool_map``, e.g. one task per LSH bucket, then
  finish in one process, e.g. union-find), and ``apply_shard`` on every shard in parallel,
  which returns one decision per document, in order.

Every rejection is written with its step name and reason, so kept plus rejected always
equals the input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from lmforge.data.documents import Document

# pool_map(fn, items) -> list of fn(item), run on the executor's workers (a process pool or Ray).
PoolMap = Callable[[Callable[[Any], Any], Iterable[Any]], list]


class DocumentStep(Protocol):
    name: str

    def __call__(self, doc: Document) -> str | None:
        """Annotate or edit ``doc``; return None to keep it, or the reason for rejecting it."""


class CorpusStep(Protocol):
    name: str

    def index_shard(self, shard: int, docs: list[Document], work_dir: Path) -> None:
        """Write what ``resolve`` needs about this shard's documents under ``work_dir``."""

    def resolve(self, work_dir: Path, num_shards: int, pool_map: PoolMap) -> None:
        """Make the global decision (which documents or lines go) and write it under ``work_dir``."""

    def apply_shard(self, shard: int, docs: list[Document], work_dir: Path) -> list[str | None]:
        """One entry per document, in order: None keeps it (possibly annotated or edited), a string rejects it."""
