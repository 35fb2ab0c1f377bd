"""The worker tasks of a curation run, one per shard: run a segment's steps over it
(``run_segment_shard``), index it for a corpus step (``run_index_shard``), write its output
and rejects (``finalize_shard``). Each writes its files atomically and then a completion
marker, so an interrupted run, started again, redoes only unfinished tasks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.core.io import atomic_write_bytes, atomic_write_json
from lmforge.curate.ids import index_ids, segment_docs, segment_rejects
from lmforge.curate.plan import Job, seg_dir
from lmforge.curate.readers import read_piece
from lmforge.curate.records import JsonlWriter, doc_record, reject_record, write_output
from lmforge.curate.stats import ShardStats
from lmforge.data.documents import Document

_BUILT: dict[tuple[str, int], tuple[Any, list[tuple[str, Any]]]] = {}


def _steps_of(job: Job, seg: int) -> tuple[Any, list[tuple[str, Any]]]:
    """The segment's built steps, once per worker process (a language model loads once). Steps of
    other segments or runs are closed first: segments run one after another, and a long-lived
    worker (a Ray cluster's) would otherwise keep every run's steps, extraction processes included."""
    key = (job.fingerprints[seg], seg)
    if key not in _BUILT:
        close_built_steps()
        segment = job.segments[seg]
        corpus = segment.corpus.build() if segment.corpus else None
        _BUILT[key] = (corpus, [(spec.label, spec.build()) for spec in segment.steps])
    return _BUILT[key]


def close_built_steps() -> None:
    """Close and forget the steps built in this process (extract: its child process)."""
    for corpus, steps in _BUILT.values():
        for step in [corpus, *(step for _, step in steps)]:
            if callable(getattr(step, "close", None)):
                step.close()
    _BUILT.clear()


def apply_steps(doc: Document, steps: list[tuple[str, Any]]) -> tuple[str, str] | None:
    """(stage, reason) of the first step that rejects ``doc``; a step that raises rejects it too."""
    for label, step in steps:
        try:
            reason = step(doc)
        except Exception as exc:  # noqa: BLE001 -- one bad document must not stop the run
            reason = f"step-error: {type(exc).__name__}: {exc}"
        if reason is not None:
            return label, reason
    return None


def run_segment_shard(job: Job, seg: int, shard: int) -> dict:
    directory = seg_dir(job, seg)
    marker = directory / f"shard-{shard:06d}.done.json"
    if marker.exists():
        return {"skipped": True, **json.loads(marker.read_text())}
    corpus, steps = _steps_of(job, seg)
    kept = JsonlWriter(directory / f"shard-{shard:06d}.kept.jsonl")
    rejects = JsonlWriter(directory / f"shard-{shard:06d}.rejects.jsonl")
    ids, kept_mask, piece_docs = [], [], []  # segment 0 also keeps what unique ids need, in reading order
    try:
        for doc, stage, reason in _segment_input(job, seg, shard, corpus, piece_docs):
            if reason is None:
                verdict = apply_steps(doc, steps)
                if verdict is not None:
                    stage, reason = verdict
            if seg == 0:
                ids.append(doc.id)
                kept_mask.append(reason is None)
            if reason is None:
                kept.write(doc_record(doc))
            else:
                rejects.write(reject_record(doc, stage, reason))
        kept.commit()
        rejects.commit()
    except BaseException:
        kept.abort()
        rejects.abort()
        raise
    result = {"in": kept.count + rejects.count, "kept": kept.count, "rejected": rejects.count}
    if seg == 0:
        index_ids(job, shard, ids, kept_mask)
        result["piece_docs"] = piece_docs
    atomic_write_json(marker, result)
    return {"skipped": False, **result}


def _segment_input(job: Job, seg: int, shard: int, corpus: Any,
                   piece_docs: list[int]) -> Iterator[tuple[Document, str, str | None]]:
    """(doc, stage, reason) for each document entering the segment; reason None means not yet rejected.
    Segment 0 counts the documents read from each piece of the shard into ``piece_docs``."""
    if seg == 0:
        for piece in job.shards[shard]:
            piece_docs.append(0)
            for doc, reason in read_piece(piece, job.inputs):
                piece_docs[-1] += 1
                yield doc, "read", reason
        return
    docs = segment_docs(job, seg - 1, shard)
    decisions = corpus.apply_shard(shard, docs, seg_dir(job, seg) / "step")
    if len(decisions) != len(docs):
        raise RuntimeError(f"{job.segments[seg].corpus.label}.apply_shard returned {len(decisions)} decisions "
                           f"for {len(docs)} documents of shard {shard}")
    for doc, reason in zip(docs, decisions):
        yield doc, job.segments[seg].corpus.label, reason


def run_index_shard(job: Job, seg: int, shard: int) -> bool:
    directory = seg_dir(job, seg)
    marker = directory / f"index-{shard:06d}.done"
    if marker.exists():
        return True
    corpus, _ = _steps_of(job, seg)
    docs = segment_docs(job, seg - 1, shard)
    corpus.index_shard(shard, docs, directory / "step")
    atomic_write_bytes(marker, b"")
    return False


def finalize_shard(job: Job, shard: int) -> dict:
    """Write the shard's kept documents and all its rejects; return its statistics."""
    root = Path(job.run_dir)
    marker = root / "work" / "final" / f"shard-{shard:06d}.stats.json"
    if marker.exists():
        return {"skipped": True, **json.loads(marker.read_text())}
    last = len(job.segments) - 1
    stats = ShardStats()
    docs = segment_docs(job, last, shard)
    for doc in docs:
        stats.add(doc.metadata, None, None)
    write_output(root / "output" / f"shard-{shard:06d}.{job.output_format}", docs, job.output_format)
    rejects = JsonlWriter(root / "rejects" / f"shard-{shard:06d}.jsonl")
    try:
        for seg in range(last + 1):
            for record in segment_rejects(job, seg, shard):
                stats.add(record["metadata"], record["stage"], record["reason"])
                rejects.write(record)
        rejects.commit()
    except BaseException:
        rejects.abort()
        raise
    result = stats.to_dict()
    atomic_write_json(marker, result)
    return {"skipped": False, **result}
