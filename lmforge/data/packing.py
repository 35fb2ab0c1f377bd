"""Batches of SFT examples: packed into fixed-length rows, or padded one example per row.

Packing (TRL's padding-free ``bfd`` strategy, torchtune's packed datasets) puts several
examples into one row of ``seq_len`` tokens. Three things keep the documents apart:
``position_ids`` restart at 0 for each document, the label of each document's first token
is masked (it would be predicted from the previous document), and ``block_causal_mask``
lets a token attend only to earlier tokens of its own document. Then the packed loss
equals the token-weighted loss of the same examples run one by one.

Labels are aligned with ``input_ids`` (unshifted); the objective shifts them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Literal

import torch

IGNORE_INDEX = -100  # label of a position without a target (torch cross_entropy's ignore_index); the one definition
Example = tuple[Sequence[int], Sequence[int]]  # (input_ids, labels)


def assign_bins(lengths: Sequence[int], capacity: int,
                strategy: Literal["bfd", "ffd", "greedy"] = "bfd") -> list[list[int]]:
    """Group example indices into bins of total length <= ``capacity``; deterministic.

    ``bfd`` (best-fit decreasing): longest first, each into the fullest bin it fits;
    ``ffd``: longest first, into the first bin it fits; ``greedy``: in order, a new bin
    when the current one is full. Within a bin, examples keep the order they were placed.
    """
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than the row length {capacity}; truncate or skip it first")
        if n == 0:
            raise ValueError(f"example {i} is empty")
    if strategy == "greedy":
        bins: list[list[int]] = []
        used = capacity
        for i, n in enumerate(lengths):
            if used + n > capacity:
                bins.append([])
                used = 0
            bins[-1].append(i)
            used += n
        return bins
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, space = [], []
    if strategy == "ffd":
        for i in order:
            j = next((j for j, s in enumerate(space) if s >= lengths[i]), len(bins))
            if j == len(bins):
                bins.append([])
                space.append(capacity)
            bins[j].append(i)
            space[j] -= lengths[i]
        return bins
    if strategy != "bfd":
        raise ValueError(f"unknown packing strategy {strategy!r}; choose bfd, ffd or greedy")
    free: list[tuple[int, int]] = []  # (remaining space, bin index), sorted
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            j, remaining = len(bins), capacity
            bins.append([])
        else:
            remaining, j = free.pop(k)
        bins[j].append(i)
        if remaining - lengths[i] > 0:
            bisect.insort(free, (remaining - lengths[i], j))
    return bins


def pack_examples(examples: Sequence[Example], seq_len: int, pad_id: int,
                  strategy: Literal["bfd", "ffd", "greedy"] = "bfd") -> dict[str, torch.Tensor]:
    """Pack ``(input_ids, labels)`` examples into rows of ``seq_len``: ``input_ids``, ``labels``, ``position_ids``.

    Each row is its documents back to back, then padding (``pad_id``, label -100) which
    forms a document of its own so that no row of the attention mask is empty.
    """
    bins = assign_bins([len(ids) for ids, _ in examples], seq_len, strategy)
    shape = (len(bins), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    for row, members in enumerate(bins):
        pos = 0
        for i in members:
            ids, lab = examples[i]
            if len(ids) != len(lab):
                raise ValueError(f"example {i}: {len(ids)} input ids but {len(lab)} labels")
            n = len(ids)
            input_ids[row, pos : pos + n] = torch.as_tensor(ids, dtype=torch.long)
            labels[row, pos : pos + n] = torch.as_tensor(lab, dtype=torch.long)
            labels[row, pos] = IGNORE_INDEX  # a document's first token is never a target
            position_ids[row, pos : pos + n] = torch.arange(n)
            pos += n
        position_ids[row, pos:] = torch.arange(seq_len - pos)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def pad_examples(examples: Sequence[Example], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """One example per row, right-padded to the longest (or ``pad_to``): ``input_ids``, ``labels``, ``position_ids``.

    Right padding needs no mask: under the causal mask real tokens never see the padding.
    """
    width = max(len(ids) for ids, _ in examples)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest example ({width} tokens)")
        width = pad_to
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        labels[row, : len(lab)] = torch.as_tensor(lab, dtype=torch.long)
    position_ids = torch.arange(width).expand(len(examples), width).clone()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of each token: a new document starts wherever ``position_ids == 0``."""
    return (position_ids == 0).long().cumsum(dim=-1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query i may attend key j: same document and j <= i."""
    doc = document_ids(position_ids)
    T = doc.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return ((doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal).unsqueeze(1)


def is_packed(position_ids: torch.Tensor) -> bool:
    """True when some row holds more than one document (a position restarts after the first token)."""
    return bool((position_ids[:, 1:] == 0).any())
