"""Which split, train or val, each document of a preparation goes to: the rules ``lmforge prepare`` offers.

- ``hash`` (the default): each document by a stable hash of its id (``split_of``), over all
  sources together; a source too small to draw a validation document may have none.
- ``source_hash``: each source file on its own: the ``n - int(n * (1 - f))`` of its ``n``
  documents with the smallest id hashes, so every source with a document has one in val.
- ``source_tail``: each source file on its own, its last share: the last ``n - int(n * (1 - f))``
  documents, or, of a source holding one document (a plain-text file), its text from character
  ``int(len * (1 - f))`` on, nanoGPT's shakespeare_char rule (``data[:int(n*0.9)]`` trains).
- ``files`` (``val_paths`` given): the validation split is those files' documents as they are
  read; every document of the train inputs goes to train.

The per-source rules read each source twice: once to count (and hash) its documents, once to
yield them; the skipped-record counts come from the second pass only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from lmforge.core.io import InputError, expand_paths
from lmforge.data.documents import (
    Document,
    DocumentsConfig,
    SkipLog,
    file_format,
    id_hash,
    read_documents,
    read_file,
    split_of,
)

SplitRule = Literal["hash", "source_hash", "source_tail"]
SPLIT_RULES: tuple[str, ...] = ("hash", "source_hash", "source_tail")
Labelled = tuple[str, Document]  # ("train" | "val", document)


def train_count(n: int, val_fraction: float) -> int:
    """How many of a source's ``n`` units (documents, or characters of one document) train:
    ``int(n * (1 - f))``, nanoGPT's ``int(n * 0.9)`` for ``f = 0.1``; the rest is validation."""
    return int(n * (1.0 - val_fraction))


def source_split(cfg: DocumentsConfig, rule: SplitRule, val_fraction: float, skipped: SkipLog) -> Iterator[Labelled]:
    """The documents of ``cfg.paths``, labelled by ``rule`` (any of ``SPLIT_RULES``)."""
    if rule == "hash":
        for doc in read_documents(cfg, skipped):
            yield split_of(doc.id, val_fraction), doc
        return
    for path in expand_paths(cfg.paths, what="document"):
        yield from (tail_of_source if rule == "source_tail" else hash_of_source)(path, cfg, val_fraction, skipped)


def tail_of_source(path: Path, cfg: DocumentsConfig, val_fraction: float, skipped: SkipLog) -> Iterator[Labelled]:
    """The ``source_tail`` rule on one file: its last documents, or the end of its one document's text."""
    n = 1 if file_format(path) == "text" else sum(1 for _ in read_file(path, cfg, SkipLog()))
    keep = train_count(n, val_fraction)
    for i, doc in enumerate(read_file(path, cfg, skipped)):
        if n == 1:
            yield from cut_text(doc, val_fraction)
        else:
            yield ("train" if i < keep else "val"), doc


def cut_text(doc: Document, val_fraction: float) -> Iterator[Labelled]:
    """One document as two: its first ``int(len * (1 - f))`` characters train, the rest is
    validation (an empty part is left out)."""
    cut = train_count(len(doc.text), val_fraction)
    for split, text in (("train", doc.text[:cut]), ("val", doc.text[cut:])):
        if text:
            yield split, Document(id=doc.id, text=text, metadata=dict(doc.metadata))


def hash_of_source(path: Path, cfg: DocumentsConfig, val_fraction: float, skipped: SkipLog) -> Iterator[Labelled]:
    """The ``source_hash`` rule on one file: validation takes its documents of the smallest id
    hashes (ties, duplicate ids, broken by position), as many as ``source_tail`` would."""
    hashes = np.fromiter((id_hash(d.id) for d in read_file(path, cfg, SkipLog())), dtype=np.uint64)
    order = np.argsort(hashes, kind="stable")
    val = np.zeros(len(hashes), dtype=bool)
    val[order[: len(hashes) - train_count(len(hashes), val_fraction)]] = True
    for i, doc in enumerate(read_file(path, cfg, skipped)):
        yield ("val" if val[i] else "train"), doc


def validation_files(patterns: list[str], train_patterns: list[str]) -> list[Path]:
    """The files ``val_paths`` names, checked: each exists and is not empty, and none is also
    a train input (the same file by any path: a link, a relative path)."""
    files = expand_paths(patterns, what="validation (val_paths)")
    train = {file_identity(p): p for p in expand_paths(train_patterns, what="document")}
    for path in files:
        if path.stat().st_size == 0:
            raise InputError(f"{path}: the validation file is empty (val_paths {patterns})")
        if (same := train.get(file_identity(path))) is not None:
            raise InputError(f"{path}: the validation file is also a train input ({same}, matched by data.paths "
                             f"{train_patterns}); a file can be in one split only: remove it from data.paths or val_paths")
    return files


def file_identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def files_split(cfg: DocumentsConfig, val_files: list[Path], skipped: SkipLog) -> Iterator[Labelled]:
    """The ``files`` rule: every document of ``val_files`` to val (first, so a file that holds no
    document fails before the train inputs are tokenized), every document of ``cfg.paths`` to train."""
    for path in val_files:
        n = 0
        for doc in read_file(path, cfg, skipped):
            n += 1
            yield "val", doc
        if n == 0:
            raise InputError(f"{path}: the validation file holds no documents (its records are blank, empty or "
                             "skipped as bad); give val_paths files with text")
    for path in expand_paths(cfg.paths, what="document"):
        for doc in read_file(path, cfg, skipped):
            yield "train", doc
