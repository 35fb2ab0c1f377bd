"""Token shards: the on-disk format every training stage reads.

A prepared dataset is a directory::

    manifest.json                 tokenizer hash, dtype, counts, unigram entropy, sources, skipped records
    train-00000.tokens.npy        flat token array (uint16 if the vocabulary fits, else uint32)
    train-00000.docs.npy          int64 offsets of document starts, plus the end (n_docs + 1)
    train-00000.scores.npy        float64 score per document (only with prepare's data.score_field)
    val-00000.tokens.npy ...

Arrays are ``.npy`` files, so ``np.load(..., mmap_mode="r")`` maps them without copying
and the dtype travels with the data. Each document is stored as
``[BOS] tokens [EOS]`` (both optional) and never straddles two shards.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.core.io import InputError, read_json, sha256_file
from lmforge.data.documents import Document
from lmforge.data.tokenizer import Tokenizer

MANIFEST = "manifest.json"
FORMAT = "lmforge-token-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def count_tokens(counts: np.ndarray, tokens: np.ndarray) -> None:
    """Add each token id's occurrences in ``tokens`` to ``counts`` (one slot per vocabulary entry)."""
    counts += np.bincount(tokens, minlength=len(counts))[: len(counts)]


def entropy_of_counts(counts: np.ndarray) -> float:
    """Entropy (nats) of the distribution the counts describe."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class ShardWriter:
    """Accumulates documents of one split and writes a shard whenever ``shard_tokens`` is
    reached; counts each token id on the way, for the split's unigram entropy."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, vocab_size: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_scores: list[float] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, tokens: np.ndarray, score: float | None = None) -> None:
        self.pending.append(tokens)
        if score is not None:
            self.pending_scores.append(score)
        self.pending_tokens += len(tokens)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        lengths = np.fromiter((len(t) for t in self.pending), dtype=np.int64, count=len(self.pending))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        stem = f"{self.split}-{len(self.shards):05d}"
        tokens_file, docs_file = f"{stem}.tokens.npy", f"{stem}.docs.npy"
        tokens = np.concatenate(self.pending).astype(self.dtype, copy=False)
        count_tokens(self.counts, tokens)
        np.save(self.out_dir / tokens_file, tokens)
        np.save(self.out_dir / docs_file, offsets)
        self.shards.append(
            {
                "tokens": tokens_file,
                "docs": docs_file,
                "n_tokens": int(offsets[-1]),
                "n_docs": len(lengths),
                "sha256": sha256_file(self.out_dir / tokens_file),
                "docs_sha256": sha256_file(self.out_dir / docs_file),
            }
        )
        if self.pending_scores:  # every document has one (the reader refuses a record without)
            scores_file = f"{stem}.scores.npy"
            np.save(self.out_dir / scores_file, np.asarray(self.pending_scores, dtype=np.float64))
            self.shards[-1].update(scores=scores_file, scores_sha256=sha256_file(self.out_dir / scores_file))
        self.pending, self.pending_scores, self.pending_tokens = [], [], 0

    def summary(self) -> dict:
        summary = {
            "n_tokens": sum(s["n_tokens"] for s in self.shards),
            "n_docs": sum(s["n_docs"] for s in self.shards),
            "shards": self.shards,
        }
        if self.counts.any():  # nats per token of a model that ignores context: the floor a trained loss must beat
            summary["unigram_entropy"] = entropy_of_counts(self.counts)
        return summary


def _batched_in_background(docs: Iterable, batch_docs: int) -> Iterator[list]:
    """Read and parse the next batch on a thread while the caller tokenizes this one."""
    q: queue.Queue = queue.Queue(maxsize=4)
    done = object()

    def produce() -> None:
        try:
            batch: list = []
            for doc in docs:
                batch.append(doc)
                if len(batch) >= batch_docs:
                    q.put(batch)
                    batch = []
            if batch:
                q.put(batch)
            q.put(done)
        except BaseException as exc:  # re-raised in the consumer, with its message intact
            q.put(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    while True:
        item = q.get()
        if item is done:
            break
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()


def tokenize_to_shards(
    docs: Iterable[tuple[str, Document]],
    tokenizer: Tokenizer,
    out_dir: Path,
    *,
    shard_tokens: int,
    add_bos: bool = True,
    add_eos: bool = True,
    batch_docs: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Tokenize ``docs``, ``(split, document)`` pairs (``lmforge.data.split`` labels them), into
    train/val shards under ``out_dir``; return the splits' summaries and per source file its
    documents and how many of them went to val.

    Output depends only on the documents, their order, their splits and the tokenizer, so the
    same inputs give byte-identical shards. ``progress(n_docs, n_bytes)`` is called per batch.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens, tokenizer.vocab_size) for s in SPLITS}
    prefix = [tokenizer.bos_id] if add_bos else []
    suffix = [tokenizer.eos_id] if add_eos else []
    sources: dict[str, list[int]] = {}  # path: [documents, of which in val]
    n_bytes = 0
    for batch in _batched_in_background(docs, batch_docs):
        encoded = tokenizer.encode_batch([d.text for _, d in batch])
        for (split, doc), ids in zip(batch, encoded):
            writers[split].add(np.array(prefix + ids + suffix, dtype=dtype), doc.metadata.get("score"))
            counts = sources.setdefault(doc.source, [0, 0])
            counts[0] += 1
            counts[1] += split == "val"
        if progress is not None:
            batch_bytes = sum(len(d.text.encode("utf-8")) for _, d in batch)
            n_bytes += batch_bytes
            progress(len(batch), batch_bytes)
    for w in writers.values():
        w.flush()
    return {
        "splits": {s: w.summary() for s, w in writers.items()},
        "sources": [{"path": p, "n_docs": n, "val_docs": v} for p, (n, v) in sources.items()],
    }


# --------------------------------------------------------------------------- reading


@dataclass
class Shard:
    tokens: np.ndarray  # memory-mapped, 1-D
    doc_starts: np.ndarray  # int64, n_docs + 1 offsets into ``tokens``
    scores: np.ndarray | None = None  # float64 per document, when prepared with data.score_field


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a prepared directory, checked for every key the readers use, so a damaged
    or hand-edited one is an ``InputError`` naming the file and the key, not a ``KeyError`` later."""
    path = Path(directory) / MANIFEST
    manifest = read_json(path, f"is {directory} a directory written by `lmforge prepare`?")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{path}: not an lmforge token-shard manifest of version {FORMAT_VERSION}")
    problem = manifest_problem(manifest)
    if problem:
        raise InputError(f"{path}: {problem}; the manifest is damaged: prepare the data again with `lmforge prepare`")
    return manifest


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_file_name(value: object) -> bool:
    """A plain file name: shards live beside their manifest, never elsewhere."""
    return isinstance(value, str) and value not in ("", ".", "..") and Path(value).name == value


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's structure (the first thing found), or None."""
    if not isinstance(manifest.get("tokenizer_sha256"), str):
        return "tokenizer_sha256 is missing or not a string"
    if manifest.get("dtype") not in (np.dtype(np.uint16).name, np.dtype(np.uint32).name):
        return f"dtype {manifest.get('dtype')!r} is not uint16 or uint32"
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        return "splits is missing or not a mapping"
    for split in SPLITS:
        info = splits.get(split)
        if not isinstance(info, dict):
            return f"splits.{split} is missing or not a mapping"
        for key in ("n_tokens", "n_docs"):
            if not _is_count(info.get(key)):
                return f"splits.{split}.{key} is {info.get(key)!r}, not a count"
        if "unigram_entropy" in info and not isinstance(info["unigram_entropy"], (int, float)):
            return f"splits.{split}.unigram_entropy is {info['unigram_entropy']!r}, not a number"
        shards = info.get("shards")
        if not isinstance(shards, list):
            return f"splits.{split}.shards is missing or not a list"
        for i, shard in enumerate(shards):
            where = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                return f"{where} is not a mapping"
            for key in ("tokens", "docs", "scores"):  # scores: only with prepare's data.score_field
                if (key in shard or key != "scores") and not _is_file_name(shard.get(key)):
                    return f"{where}.{key} is {shard.get(key)!r}, not a file name"
            for key in ("n_tokens", "n_docs"):
                if not _is_count(shard.get(key)):
                    return f"{where}.{key} is {shard.get(key)!r}, not a count"
            for key in ("sha256", "docs_sha256", "scores_sha256"):  # docs_sha256: absent from manifests before it
                if (key in shard or key == "sha256") and not isinstance(shard.get(key), str):
                    return f"{where}.{key} is {shard.get(key)!r}, not a sha256 digest"
        for key in ("n_tokens", "n_docs"):
            total = sum(s[key] for s in shards)
            if info[key] != total:
                return f"splits.{split}.{key} is {info[key]} but its shards hold {total}"
    return None


def verify_shards(directory: Path, manifest: dict, split: str) -> None:
    """Hash every file of ``split`` against the sha256 the manifest recorded when it was written.

    Sizes catch truncation; only the hash catches a shard changed in place (a flipped bit, a
    file copied over from another preparation), which would silently change what a run reads."""
    from lmforge.core.run import log

    shards = manifest["splits"][split]["shards"]
    size = sum((directory / s["tokens"]).stat().st_size + (directory / s["docs"]).stat().st_size for s in shards)
    log.info("verifying %d %s shards (%.2f GB) of %s against %s", len(shards), split, size / 1e9, directory, MANIFEST)
    for info in shards:
        for key, name in (("sha256", info["tokens"]), ("docs_sha256", info["docs"]),
                          ("scores_sha256", info.get("scores"))):
            expected = info.get(key)
            if expected is None:
                continue
            found = sha256_file(directory / name)
            if found != expected:
                raise InputError(f"{directory / name}: sha256 {found} does not match {expected} recorded in "
                                 f"{directory / MANIFEST}; the shard was corrupted or changed after `lmforge prepare` "
                                 "(prepare the data again)")


def _load_array(path: Path, mmap: bool) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as exc:
        raise InputError(f"{path}: cannot read shard: {exc}") from exc


def _is_document_index(doc_starts: np.ndarray, n_docs: int, n_tokens: int) -> bool:
    """``n_docs + 1`` non-decreasing int64 offsets from 0 to ``n_tokens``."""
    return (doc_starts.dtype == np.int64 and doc_starts.ndim == 1 and len(doc_starts) == n_docs + 1
            and doc_starts[0] == 0 and doc_starts[-1] == n_tokens and bool(np.all(np.diff(doc_starts) >= 0)))


def open_shards(directory: str | Path, split: str = "train", verify: bool = False) -> list[Shard]:
    """Memory-map every shard of ``split``; checks sizes against the manifest and, with ``verify``,
    the files' sha256 (which reads them whole)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if split not in manifest["splits"]:
        raise InputError(f"{directory}: no split {split!r} (has {sorted(manifest['splits'])})")
    for info in manifest["splits"][split]["shards"]:
        for name in (info["tokens"], info["docs"], *([info["scores"]] if "scores" in info else [])):
            if not (directory / name).is_file():
                raise InputError(f"{directory / MANIFEST}: lists shard file {name} of split {split!r}, "
                                 f"which is not in {directory}")
    if verify:
        verify_shards(directory, manifest, split)
    dtype = np.dtype(manifest["dtype"])
    shards = []
    for info in manifest["splits"][split]["shards"]:
        tokens_path, docs_path = directory / info["tokens"], directory / info["docs"]
        tokens, doc_starts = _load_array(tokens_path, mmap=True), _load_array(docs_path, mmap=False)
        if tokens.dtype != dtype or tokens.ndim != 1 or len(tokens) != info["n_tokens"]:
            raise InputError(f"{tokens_path}: expected {info['n_tokens']} {dtype} tokens, found {tokens.size} {tokens.dtype}")
        if not _is_document_index(doc_starts, info["n_docs"], len(tokens)):
            raise InputError(f"{docs_path}: document index does not match its token file")
        scores = None
        if "scores" in info:
            scores = _load_array(directory / info["scores"], mmap=False)
            if scores.dtype != np.float64 or scores.shape != (info["n_docs"],):
                raise InputError(f"{directory / info['scores']}: expected {info['n_docs']} float64 document scores, "
                                 f"found {scores.shape} {scores.dtype}")
        shards.append(Shard(tokens=tokens, doc_starts=doc_starts, scores=scores))
    return shards
