"""Replay in fine-tuning: windows of earlier (pre-training) data as rows beside a stage's own rows.

A fine-tuning stage's rows are a dict of ``(N, T)`` tensors, shuffled and served by a ``RowLoader``.
Replay sets (``data.replay``, the ``ReplaySource`` of pre-training's mixture: a prepared directory and
its share) add ``round(N * share / (1 - Σ share))`` rows each, so that a share of the rows the loader
draws is theirs: BOS-aligned windows of ``T`` tokens in the seeded order of ``TokenLoader``, every
label set (``input_ids == labels``, positions ``0 .. T-1``), which the masked causal LM loss of SFT
then trains as the plain LM loss on those rows. The rows are fixed for the run (an epoch of the
stage's rows replays the same windows), so the ``RowLoader``'s state resumes them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmforge.core.io import InputError
from lmforge.data.loader import DatasetSource, LoaderConfig, ReplaySource, TokenLoader
from lmforge.data.shards import read_manifest


@dataclass
class RowGroups:
    """Which group each row of a ``RowLoader`` belongs to (0: the stage's own rows), for the share of
    each that the loader draws (``RowLoader.pop_metrics``: ``data/drawn/<name>``)."""

    names: list[str]
    of_row: np.ndarray


def check_replay(replay: list[ReplaySource], tokenizer_sha256: str, key: str = "data.replay") -> None:
    """Each replay set is a prepared directory tokenized with the stage's tokenizer (``InputError`` naming the key)."""
    for i, r in enumerate(replay):
        try:
            manifest = read_manifest(r.path)
        except InputError as exc:
            raise InputError(f"{key}[{i}].path = {r.path}: no prepared dataset there ({exc}); give a directory "
                             "written by `lmforge prepare`") from exc
        if manifest["tokenizer_sha256"] != tokenizer_sha256:
            raise InputError(f"{key}[{i}].path = {r.path} was tokenized with another tokenizer than the model's: "
                             "prepare it again with the checkpoint's tokenizer")


def replay_rows(rows: dict[str, torch.Tensor], replay: list[ReplaySource], seed: int,
                name: str = "sft") -> tuple[dict[str, torch.Tensor], RowGroups]:
    """``rows`` (``input_ids``, ``labels``, ``position_ids`` of width ``T``) with each replay set's
    windows of ``T`` tokens appended, and the group of every row (``name`` for the stage's own)."""
    n, width = rows["input_ids"].shape
    rest = 1.0 - sum(r.share for r in replay)
    parts, groups = [rows], [np.zeros(n, dtype=np.int64)]
    for j, r in enumerate(replay, start=1):
        count = round(n * r.share / rest)
        if count == 0:
            continue
        cfg = LoaderConfig(datasets=[DatasetSource(r.path)], seq_len=width - 1, seed=seed)
        windows = next(TokenLoader(cfg, count))  # the first `count` windows of its seeded order
        parts.append({"input_ids": windows, "labels": windows.clone(),
                      "position_ids": torch.arange(width).expand(count, width).clone()})
        groups.append(np.full(count, j, dtype=np.int64))
    keys = rows.keys()
    for part in parts[1:]:
        if part.keys() != keys:
            raise ValueError(f"replay rows have {sorted(part)}, the stage's rows {sorted(keys)}")
    mixed = {k: torch.cat([p[k].to(rows[k].dtype) for p in parts]) for k in keys}
    names = [name, *(DatasetSource(r.path, 1.0, r.name).label for r in replay)]
    return mixed, RowGroups(names, np.concatenate(groups))
