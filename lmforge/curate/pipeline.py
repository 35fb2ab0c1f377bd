"""The curation pipeline: read shards, run the steps, write kept documents, rejects and stats.

The steps are cut into segments at each corpus step. Segment 0 reads each input shard and
runs the document steps before the first corpus step; each later segment starts with a
corpus step (``index_shard`` on every shard, ``resolve`` once, ``apply_shard`` on every
shard) and continues with the document steps after it. Finally each shard's kept
documents go to ``output/`` and all its rejects, with stage and reason, to ``rejects/``.
Between segment 0 and the rest, repeated input ids are made unique (see "unique ids" below).

Every shard task writes its files atomically and then a completion marker, so an
interrupted run, started again, redoes only unfinished tasks. Markers carry a fingerprint
of the inputs and of the steps up to their segment, with the files the steps' configs name
(a blocklist, a model folder): change a step or such a file and that segment and the ones
after it run again, the earlier ones are reused.

    run_dir/
      config.yaml, stats.json, report.md, report.png
      output/shard-00000.parquet    id, text, metadata (JSON)   -- what `lmforge prepare` reads
      rejects/shard-00000.jsonl     id, text, metadata, stage, reason
      work/                         per-segment documents, corpus-step indexes, markers
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from lmforge.core.config import at_least, dump_config, save_config
from lmforge.core.io import (
    InputError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_npy,
    file_stamps,
    is_temporary,
    named_paths,
    temporary_file,
)
from lmforge.core.run import log, progress_bar
from lmforge.curate.executor import make_executor
from lmforge.curate.readers import InputsConfig, Piece, plan_shards, read_piece
from lmforge.curate.steps import StepSpec, is_corpus_step, parse_steps
from lmforge.data.documents import Document

DEFAULT_STEPS: list[dict[str, Any]] = [
    {"type": "extract"},
    {"type": "language"},
    {"type": "gopher_repetition"},
    {"type": "gopher_quality"},
    {"type": "c4_quality", "filter_no_terminal_punct": False},
    {"type": "fineweb_quality"},
    {"type": "exact_dedup"},
]


@dataclass
class CurateConfig:
    run_dir: str = "runs/curate"
    inputs: InputsConfig = field(default_factory=InputsConfig)
    # each step: {type: <step type>, name: <optional label>, <that type's keys>}; see docs/curate.md
    steps: list[dict[str, Any]] = field(default_factory=lambda: [dict(s) for s in DEFAULT_STEPS])
    output_format: Literal["parquet", "jsonl"] = "parquet"
    executor: Literal["local", "ray"] = "local"
    workers: int = at_least(1, 2)  # local processes (1: in this process), or CPUs of a local Ray
    ray_address: str | None = None  # executor ray: "auto" joins a running cluster; null starts one
    known_duplicates: str | None = None  # TSV url_a, url_b[, kind, jaccard]: dedup precision/recall in the report

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        # check every step's keys now and store them resolved, with defaults, in config.yaml
        self.steps = [spec.to_dict() for spec in parse_steps(self.steps)]

    def step_specs(self) -> list[StepSpec]:
        return parse_steps(self.steps)


# --------------------------------------------------------------------------- plan


@dataclass
class Segment:
    corpus: StepSpec | None  # the corpus step this segment starts with (None for segment 0)
    steps: list[StepSpec]  # document steps after it


@dataclass
class Job:
    """Everything a worker needs for one run; small and picklable."""

    run_dir: str
    inputs: InputsConfig
    shards: list[list[Piece]]
    segments: list[Segment]
    fingerprints: list[str]  # per segment, cumulative
    output_format: str


def split_segments(specs: list[StepSpec]) -> list[Segment]:
    segments = [Segment(None, [])]
    for spec in specs:
        if is_corpus_step(_step_class(spec)):
            segments.append(Segment(spec, []))
        else:
            segments[-1].steps.append(spec)
    return segments


def _step_class(spec: StepSpec) -> type:
    from lmforge.curate.steps import _load

    return _load(spec.type)[1]


WORK_LAYOUT = 2  # what work/ holds; a change makes an older run's work folders redo everything


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _step_fingerprint(spec: StepSpec) -> list:
    config = spec.to_dict()
    return [config, file_stamps(named_paths(config))]  # and what the step reads besides documents


def _fingerprints(cfg: CurateConfig, shards: list[list[Piece]], segments: list[Segment]) -> list[str]:
    """Per segment, a digest of the inputs (paths, sizes, mtimes), of the steps up to it and of
    the files those steps name, so changing any of them reruns that segment and the later ones."""
    files = sorted({p.path for s in shards for p in s})
    fp = _digest(WORK_LAYOUT, dump_config(cfg.inputs), [[vars(p) for p in s] for s in shards], file_stamps(files))
    out = []
    for seg in segments:
        fp = _digest(fp, _step_fingerprint(seg.corpus) if seg.corpus else None,
                     [_step_fingerprint(s) for s in seg.steps])
        out.append(fp)
    return out


def _fresh(directory: Path, fingerprint: str, clear: tuple[Path, ...] = ()) -> None:
    """Empty ``directory`` (and the ``clear`` directories that hold its results) unless it holds
    work of this fingerprint; the stamp is written last, so a crash leaves nothing stale."""
    stamp = directory / "FINGERPRINT"
    if stamp.exists() and stamp.read_text() == fingerprint:
        return
    for d in (*clear, directory):
        shutil.rmtree(d, ignore_errors=True)
    directory.mkdir(parents=True)
    stamp.write_text(fingerprint)


def seg_dir(job: Job, seg: int) -> Path:
    return Path(job.run_dir) / "work" / f"seg-{seg}"


def clean_leftovers(run_dir: Path, num_segments: int) -> None:
    """Remove what a killed run leaves behind: the temporary files and folders of writes it did
    not finish (in ``work/``, ``output/``, ``rejects/`` and the run folder itself), and the work
    folders of segments beyond ``num_segments`` (a recipe that now has fewer corpus steps).

    Every such write belongs to a run of this folder, and this runs before any task starts,
    so every temporary sibling found is stale.
    """
    work = run_dir / "work"
    for d in work.glob("seg-*"):
        if re.fullmatch(r"seg-\d+", d.name) and int(d.name[4:]) >= num_segments and d.is_dir():
            shutil.rmtree(d)
    temps = [p for p in run_dir.iterdir() if is_temporary(p)]
    for top in (work, run_dir / "output", run_dir / "rejects"):
        for root, dirs, files in os.walk(top):
            found = [Path(root) / name for name in dirs + files if is_temporary(Path(root) / name)]
            dirs[:] = [name for name in dirs if Path(root) / name not in found]  # removed whole, not walked
            temps += found
    for path in temps:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- document files


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


# --------------------------------------------------------------------------- worker tasks

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


# --------------------------------------------------------------------------- unique ids
#
# Output ids are unique. A document keeps its input id unless a document before it in input
# order (all inputs, kept or rejected) has the same id; then its id becomes
# "<id>@<source>#<n>": the file it was read from, and its place among the documents read from
# that file (counting from 1). So the first holder of an id keeps it, and ids depend on the
# inputs alone, not on the steps or the sharding. (Unique unless an input id already has that
# form.) datatrove passes its readers' ids through, repeated or not; here every id names one
# document, as the dedup reasons ("exact-duplicate of <id>"), clusters and the report need.
#
# Segment 0 hashes each shard's ids into exact_dedup's bucket files (work/seg-0/ids/), the
# buckets are resolved in parallel (the first (shard, position) of each hash wins; two ids
# sharing a 64-bit hash would only cost one an unneeded suffix), and the repeats are renamed
# when segment 0's documents are read back, so no process holds all ids.

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


# --------------------------------------------------------------------------- statistics


def reason_key(reason: str) -> str:
    """The rule of a reason: its first word ("gopher_short_doc: 12 < 50" -> "gopher_short_doc")."""
    head = reason.strip().split(None, 1)[0] if reason.strip() else "unknown"
    return head.rstrip(":")


MAX_SCORE_SAMPLES = 20_000  # per shard and score, every k-th value beyond that


@dataclass
class ShardStats:
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)  # "stage\treason" -> n
    languages: dict[str, Counter] = field(default_factory=lambda: {"kept": Counter(), "rejected": Counter()})
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    dup_cluster_sizes: list[int] = field(default_factory=list)

    def add(self, meta: dict, stage: str | None, reason: str | None) -> None:
        side = "kept" if stage is None else "rejected"
        if stage is None:
            self.kept += 1
            if isinstance(meta.get("dup_cluster_size"), int):
                self.dup_cluster_sizes.append(meta["dup_cluster_size"])
        else:
            self.rejected[f"{stage}\t{reason_key(reason or '')}"] += 1
        if "language" in meta:
            self.languages[side][str(meta["language"])] += 1
        for key, value in meta.items():
            if key.endswith("_score") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values = self.scores.setdefault(key, {"kept": [], "rejected": []})[side]
                if len(values) < MAX_SCORE_SAMPLES:
                    values.append(float(value))

    def to_dict(self) -> dict:
        return {"kept": self.kept, "rejected": dict(self.rejected),
                "languages": {k: dict(v) for k, v in self.languages.items()},
                "scores": self.scores, "dup_cluster_sizes": self.dup_cluster_sizes}


def merge_stats(parts: list[dict], specs: list[StepSpec]) -> dict:
    by_stage: dict[str, Counter] = {}
    languages: dict[str, Counter] = {"kept": Counter(), "rejected": Counter()}
    scores: dict[str, dict[str, list[float]]] = {}
    clusters: list[int] = []
    kept = 0
    for p in parts:
        kept += p["kept"]
        for key, n in p["rejected"].items():
            stage, reason = key.split("\t", 1)
            by_stage.setdefault(stage, Counter())[reason] += n
        for side in ("kept", "rejected"):
            languages[side].update(p["languages"][side])
        for key, sides in p["scores"].items():
            for side, values in sides.items():
                scores.setdefault(key, {"kept": [], "rejected": []})[side].extend(values)
        clusters += p["dup_cluster_sizes"]
    order = ["read"] + [s.label for s in specs]
    stages = {}
    remaining = kept + sum(sum(c.values()) for c in by_stage.values())
    for stage in order + sorted(set(by_stage) - set(order)):
        counts = by_stage.get(stage, Counter())
        n = sum(counts.values())
        stages[stage] = {"in": remaining, "rejected": n, "reasons": dict(counts.most_common())}
        remaining -= n
    rejected = sum(s["rejected"] for s in stages.values())
    all_langs = languages["kept"] + languages["rejected"]
    return {
        "documents": kept + rejected,
        "kept": kept,
        "rejected": rejected,
        "stages": stages,
        "languages": {"all": dict(all_langs.most_common()), "kept": dict(languages["kept"].most_common())},
        "dup_cluster_sizes": dict(sorted(Counter(clusters).items())),
        "scores": scores,
    }


# --------------------------------------------------------------------------- driver


def run_tasks(pool: Any, fn: Any, items: list, desc: str) -> list:
    bar = progress_bar(len(items), desc, unit="shard")
    out = []
    for result in pool.imap(fn, items):
        out.append(result)
        bar.update(1)
    bar.close()
    return out


def _star(fn: Any, args: tuple) -> Any:
    return fn(*args)


def run_curate(cfg: CurateConfig) -> dict:
    """Run the pipeline described by ``cfg``; return the statistics also written to stats.json."""
    t0 = time.perf_counter()
    specs = cfg.step_specs()
    run_dir = Path(cfg.run_dir)
    shards = plan_shards(cfg.inputs)
    segments = split_segments(specs)
    fingerprints = _fingerprints(cfg, shards, segments)
    job = Job(str(run_dir), cfg.inputs, shards, segments, fingerprints, cfg.output_format)
    run_dir.mkdir(parents=True, exist_ok=True)
    clean_leftovers(run_dir, len(segments))
    save_config(cfg, run_dir)
    n = len(shards)
    log.info("curate: %d shards, %d steps in %d segments, executor %s with %d workers",
             n, len(specs), len(segments), cfg.executor, cfg.workers)
    ran = skipped = 0
    pool = make_executor(cfg.executor, cfg.workers, cfg.ray_address)
    try:
        for seg, segment in enumerate(segments):
            directory = seg_dir(job, seg)
            _fresh(directory, fingerprints[seg])
            if segment.corpus is not None:
                done = run_tasks(pool, partial(_star, run_index_shard), [(job, seg, k) for k in range(n)],
                                 f"{segment.corpus.label} index")
                skipped += sum(done)
                ran += len(done) - sum(done)
                resolved = directory / "resolve.done"
                if not resolved.exists():
                    segment.corpus.build().resolve(directory / "step", n, pool)
                    atomic_write_bytes(resolved, b"")
                    ran += 1
                else:
                    skipped += 1
            desc = ", ".join(s.label for s in segment.steps) or "read"
            results = run_tasks(pool, partial(_star, run_segment_shard), [(job, seg, k) for k in range(n)],
                                f"{segment.corpus.label + ' apply' if segment.corpus else 'read'}: {desc}")
            skipped += sum(r["skipped"] for r in results)
            ran += sum(not r["skipped"] for r in results)
            if seg == 0:
                n_input = sum(r["in"] for r in results)
                if n_input == 0:
                    raise InputError(f"no documents in {', '.join(cfg.inputs.paths)}: the input is empty (a WARC's "
                                     f"records count when of a type in inputs.warc_record_types: "
                                     f"{', '.join(cfg.inputs.warc_record_types)})")
                reused = resolve_ids(job, results, pool)
                skipped += reused
                ran += not reused
        final_fp = _digest(fingerprints[-1], cfg.output_format)
        _fresh(run_dir / "work" / "final", final_fp, clear=(run_dir / "output", run_dir / "rejects"))
        parts = run_tasks(pool, partial(finalize_shard, job), list(range(n)), "write output")
        skipped += sum(p["skipped"] for p in parts)
        ran += sum(not p["skipped"] for p in parts)
    finally:
        pool.close()
        close_built_steps()
    stats = merge_stats(parts, specs)
    if stats["documents"] != n_input:
        raise RuntimeError(f"curate lost documents: read {n_input}, kept {stats['kept']} + rejected {stats['rejected']}")
    stats.update(input_shards=n, tasks_run=ran, tasks_skipped=skipped, wall_s=round(time.perf_counter() - t0, 2),
                 workers=cfg.workers, executor=cfg.executor, output=str(run_dir / "output"),
                 rejects=str(run_dir / "rejects"))
    if cfg.known_duplicates:
        from lmforge.curate.report import dedup_quality

        stats["dedup"] = dedup_quality(run_dir, specs, cfg.known_duplicates)
    from lmforge.curate.report import write_report

    write_report(run_dir, stats)
    log.info("curate: %d documents -> %d kept, %d rejected in %.1f s -> %s", stats["documents"], stats["kept"],
             stats["rejected"], stats["wall_s"], run_dir)
    return stats


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


__all__ = ["CurateConfig", "run_curate", "iter_run_records", "reason_key"]
