"""Stateful loader of fixed-length training windows from token shards.

Each sample is ``seq_len + 1`` consecutive tokens (inputs and shifted targets). Windows
are cut once per dataset (``window_starts``), shuffled per epoch from the seed, and drawn
from several datasets by weight. Sample ``i`` of the global stream depends only on the
seed and ``i``: data-parallel rank ``r`` of ``w`` takes rows ``r*B .. (r+1)*B`` of every
global batch of ``w*B`` samples, so ranks never overlap, and ``state_dict()`` is just
counters, so a resumed loader gives exactly the batches an uninterrupted one would.
Samples of the stream can be skipped (``skip_samples``, what a loss-spike rollback does):
they are passed over, never served, and every other sample keeps its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.core.config import option, positive, seed_field
from lmforge.core.io import InputError
from lmforge.data.shards import Shard, open_shards, read_manifest
from lmforge.data.skipped import SkippedSamples


@dataclass
class DatasetSource:
    path: str = option(help="a directory written by ``lmforge prepare``")
    weight: float = positive(1.0, help="its share of the samples drawn, relative to the other datasets' weights")
    name: str | None = option(
        None, help="of its validation metrics in a mixture (val/<name>/loss); None: the directory's name"
    )

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"dataset weight must be positive, got {self.weight} for {self.path}")
        if self.name is not None and (not self.name or "/" in self.name or self.name != self.name.strip()):
            raise ValueError(f"dataset name {self.name!r} of {self.path} must be non-empty, without '/' or "
                             "surrounding spaces (it names metrics: val/<name>/loss)")

    @property
    def label(self) -> str:
        """The name of this dataset's metrics: ``name``, else the last part of its path."""
        return self.name or Path(self.path).resolve().name


@dataclass
class LoaderConfig:
    """Which token datasets to read and how to cut them into windows."""

    datasets: list[DatasetSource] = option(default_factory=list, help="the prepared token datasets, mixed by weight")
    seq_len: int = positive(
        256, help="tokens per training sequence (each window holds seq_len + 1: inputs and targets)"
    )
    bos_aligned: bool = option(True, help="start windows at document starts where the documents allow")
    shuffle: bool = option(True, help="windows in a seeded order per epoch, else in file order")
    seed: int = seed_field(0, help="the seed of the window order and of the mixture's draws")
    verify_shards: bool = option(
        False, help="hash every shard against its manifest first (always on when a run resumes)"
    )
    weights_from: str | None = option(
        None, help="a domain-weights JSON (`lmforge doremi`'s domain_weights.json) whose weight for each dataset, by "
        "its name, replaces the datasets' own `weight:` (lmforge.data.doremi.apply_domain_weights)"
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {self.seq_len}")


def window_starts(doc_starts: np.ndarray, n_tokens: int, seq_len: int, bos_aligned: bool) -> np.ndarray:
    """Start offsets of the ``seq_len + 1``-token windows of one shard.

    Contiguous windows tile the shard with a stride of ``seq_len`` (each shares its last
    token, a target, with the next window's first input). BOS-aligned windows start at a
    document start: when a window ends inside a document that began within it, the next
    window restarts at that document's BOS, so no token is dropped and a document is never
    entered mid-way; only a document longer than a window is continued mid-document.
    """
    if n_tokens < seq_len + 1:
        return np.zeros(0, dtype=np.int64)
    if not bos_aligned:
        return np.arange(0, n_tokens - seq_len, seq_len, dtype=np.int64)
    starts = []
    pos = int(doc_starts[0])
    last = n_tokens - seq_len - 1
    while pos <= last:
        starts.append(pos)
        end = pos + seq_len
        cut_doc_start = int(doc_starts[np.searchsorted(doc_starts, end, side="right") - 1])
        pos = cut_doc_start if cut_doc_start > pos else end
    return np.asarray(starts, dtype=np.int64)


class TokenDataset:
    """All windows of one split of one prepared directory."""

    def __init__(self, path: str | Path, split: str, seq_len: int, bos_aligned: bool, verify: bool = False):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.shards: list[Shard] = open_shards(self.path, split, verify=verify)
        per_shard = [window_starts(s.doc_starts, len(s.tokens), seq_len, bos_aligned) for s in self.shards]
        self.shard_of = np.concatenate([np.full(len(w), i, dtype=np.int32) for i, w in enumerate(per_shard)] or [np.zeros(0, np.int32)])
        self.start_of = np.concatenate(per_shard or [np.zeros(0, np.int64)])
        self.seq_len = seq_len
        if len(self) == 0:
            n = sum(len(s.tokens) for s in self.shards)
            raise InputError(f"{self.path}: split {split!r} has {n} tokens, too few for one window of {seq_len + 1}")

    def __len__(self) -> int:
        return len(self.start_of)

    def window(self, index: int) -> np.ndarray:
        shard = self.shards[self.shard_of[index]]
        start = int(self.start_of[index])
        return shard.tokens[start : start + self.seq_len + 1]


def _uniform(seed: int, indices: np.ndarray) -> np.ndarray:
    """Counter-based uniforms in [0, 1): splitmix64 of (seed, sample index)."""
    with np.errstate(over="ignore"):
        z = indices.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class TokenLoader:
    """Yields ``(batch_size, seq_len + 1)`` int64 tensors for one data-parallel rank.

    With ``loop=True`` (training) it cycles through epochs forever; with ``loop=False``
    (evaluation, one dataset) it visits every window once and stops, until ``restart()``.
    """

    def __init__(
        self,
        cfg: LoaderConfig,
        batch_size: int,
        *,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        loop: bool = True,
    ):
        if not cfg.datasets:
            raise InputError("no datasets configured for the loader")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.cfg, self.batch_size, self.rank, self.world_size, self.loop = cfg, batch_size, rank, world_size, loop
        self.datasets = [TokenDataset(d.path, split, cfg.seq_len, cfg.bos_aligned, cfg.verify_shards) for d in cfg.datasets]
        if not loop and len(self.datasets) != 1:
            raise InputError("a non-looping (evaluation) loader reads exactly one dataset")
        hashes = {d.manifest["tokenizer_sha256"] for d in self.datasets}
        if len(hashes) > 1:
            raise InputError(f"datasets were tokenized with different tokenizers: {[str(d.path) for d in self.datasets]}")
        weights = np.array([d.weight for d in cfg.datasets], dtype=np.float64)
        self.cum_weights = np.cumsum(weights / weights.sum())
        self.cum_weights[-1] = 1.0
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self.restart()

    def restart(self) -> TokenLoader:
        """Back to the first sample: an evaluation loader built once yields the same batches
        each time it is restarted, as a new one would."""
        self.samples = 0  # global samples consumed by all ranks together
        self.cursors = [[0, 0] for _ in self.datasets]  # per dataset: epoch, position in epoch
        self.skipped = SkippedSamples()
        return self

    def skip_samples(self, start: int, stop: int) -> None:
        """Never serve global samples ``start .. stop - 1`` (a training loader only)."""
        if not self.loop:
            raise ValueError("only a training (looping) loader can skip samples")
        self.skipped.add(start, stop)

    # -- order
    def _permutation(self, d: int, epoch: int) -> np.ndarray | None:
        if not self.cfg.shuffle:
            return None
        key = (d, epoch)
        if key not in self._perm_cache:
            self._perm_cache = {k: v for k, v in self._perm_cache.items() if k[0] != d}
            rng = np.random.default_rng([self.cfg.seed, d, epoch])
            self._perm_cache[key] = rng.permutation(len(self.datasets[d]))
        return self._perm_cache[key]

    def _next_window(self, d: int) -> int:
        epoch, pos = self.cursors[d]
        if pos >= len(self.datasets[d]):
            epoch, pos = epoch + 1, 0
        perm = self._permutation(d, epoch)
        index = int(perm[pos]) if perm is not None else pos
        self.cursors[d] = [epoch, pos + 1]
        return index

    # -- iteration
    def __iter__(self) -> TokenLoader:
        return self

    def _choices(self, start: int, stop: int) -> np.ndarray:
        """The dataset each global sample ``start .. stop - 1`` is drawn from."""
        return np.searchsorted(self.cum_weights, _uniform(self.cfg.seed, np.arange(start, stop)), side="right")

    def _pass_over(self, start: int, stop: int) -> None:
        """Advance the cursors past samples ``start .. stop - 1`` as if they were served."""
        for chunk in range(start, stop, 1 << 20):
            counts = np.bincount(self._choices(chunk, min(stop, chunk + (1 << 20))), minlength=len(self.datasets))
            for d, k in enumerate(counts.tolist()):
                if k:
                    epoch, pos = self.cursors[d]
                    if pos >= len(self.datasets[d]):
                        epoch, pos = epoch + 1, 0
                    wraps = (pos + k - 1) // len(self.datasets[d])  # as k calls of _next_window would leave it
                    self.cursors[d] = [epoch + wraps, pos + k - wraps * len(self.datasets[d])]

    def __next__(self) -> torch.Tensor:
        global_batch = self.batch_size * self.world_size
        if not self.loop:
            remaining = len(self.datasets[0]) - self.samples
            if remaining <= 0:
                raise StopIteration
            global_batch = min(global_batch, remaining)
        picks: list[tuple[int, int]] = []
        while len(picks) < global_batch:
            kept = self.skipped.next_kept(self.samples)
            self._pass_over(self.samples, kept)
            stop = int(min(kept + global_batch - len(picks), self.skipped.next_skipped(kept)))
            picks += [(int(d), self._next_window(int(d))) for d in self._choices(kept, stop)]
            self.samples = stop
        mine = picks[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        self.sources = np.array([d for d, _ in mine], dtype=np.int64)  # the dataset of each row (DoReMi's domains)
        if not mine:  # the last evaluation batch can leave a rank without rows
            return torch.zeros((0, self.cfg.seq_len + 1), dtype=torch.long)
        rows = np.stack([self.datasets[d].window(w) for d, w in mine]).astype(np.int64)
        return torch.from_numpy(rows)

    # -- exact resume
    def state_dict(self) -> dict:
        return {
            "samples": self.samples,
            "cursors": [list(c) for c in self.cursors],
            "windows": [len(d) for d in self.datasets],
            "seed": self.cfg.seed,
            "seq_len": self.cfg.seq_len,
            "skipped": self.skipped.to_list(),
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("seq_len", self.cfg.seq_len), ("seed", self.cfg.seed), ("windows", [len(d) for d in self.datasets])):
            if state[key] != mine:
                raise InputError(f"loader state does not match this data: saved {key}={state[key]}, now {mine}; "
                                 "the data or its windows changed since the checkpoint: use a new run_dir or train.resume=never")
        self.samples = int(state["samples"])
        self.cursors = [[int(e), int(p)] for e, p in state["cursors"]]
        self.skipped = SkippedSamples(state.get("skipped"))  # absent from states saved before skipping existed
