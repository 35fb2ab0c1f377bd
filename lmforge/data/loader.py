"""Stateful loader of fixed-length training windows from token shards.

Each sample is ``seq_len + 1`` consecutive tokens (inputs and shifted targets). Windows
are cut once per dataset (``window_starts``), shuffled per epoch from the seed, and drawn
from several datasets by weight. Sample ``i`` of the global stream depends only on the
seed and ``i``: data-parallel rank ``r`` of ``w`` takes rows ``r*B .. (r+1)*B`` of every
global batch of ``w*B`` samples, so ranks never overlap, and ``state_dict()`` is just
counters, so a resumed loader gives exactly the batches an uninterrupted one would.
Samples of the stream can be skipped (``skip_samples``, what a loss-spike rollback does):
they are passed over, never served, and every other sample keeps its window.

Curricula are schedules over the sample index, so they too are pure functions of the seed and
the index and resume exactly: replay sets drawn at a fixed share (``replay``), mixture weights
that change at given steps (``mixture_schedule``), short windows first (``seq_len_warmup``) and
windows ordered by their document's score (``score_order``). Sample ``i`` belongs to step
``i // samples_per_step`` (the step it is drawn for in a run that skips nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lmforge.core.config import ConfigError, at_least, option, positive, seed_field, unit_interval
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
class ReplaySource:
    """An earlier stage's data mixed back in at a fixed share of the draws (replay against forgetting)."""

    path: str = option(help="a directory written by ``lmforge prepare``: the earlier stage's data")
    share: float = unit_interval(0.1, low_open=True, high_open=True,
                                 help="its share of the samples drawn; data.datasets share the rest by their weights")
    name: str | None = option(None, help="of its validation metrics (val/<name>/loss); None: the directory's name")

    def as_source(self, weight: float) -> DatasetSource:
        return DatasetSource(self.path, weight, self.name)


@dataclass
class MixturePoint:
    """The mixture weights from one step on (``piecewise``) or reached at it (``linear``)."""

    step: int = at_least(0, help="the optimizer step (0-based) these weights belong to")
    weights: list[float] = at_least(0, default_factory=list,
                                    help="one per dataset of data.datasets, in order, relative (their sum > 0)")


@dataclass
class SeqLenWarmup:
    """Short windows first (Li et al. 2022): each window is cut into pieces of a length that grows
    linearly from ``start`` to ``data.seq_len`` over ``steps`` steps."""

    steps: int = positive(help="steps over which the piece length grows to data.seq_len")
    start: int = positive(32, help="the first steps' piece length in tokens; must divide data.seq_len")


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
    replay: list[ReplaySource] = option(
        default_factory=list, help="earlier stages' data drawn at fixed shares (replay against forgetting)"
    )
    mixture_schedule: list[MixturePoint] = option(
        default_factory=list,
        help="data.datasets' weights at given steps (the datasets' own weights hold at step 0 unless a point is there)",
    )
    mixture_interpolation: Literal["piecewise", "linear"] = option(
        "piecewise", help="between the schedule's points: the last point's weights, or linearly towards the next"
    )
    seq_len_warmup: SeqLenWarmup | None = option(
        None, help="short windows first: the same tokens per step, cut into shorter rows (docs/curricula.md)"
    )
    score_order: Literal["none", "ascending", "descending"] = option(
        "none",
        help="windows in order of their document's score (prepare's data.score_field), lowest first (ascending) "
        "or highest first, ties in the seeded order; none: the seeded order",
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {self.seq_len}")
        if sum(r.share for r in self.replay) >= 1:
            raise ValueError(f"replay shares sum to {sum(r.share for r in self.replay):g}; they must leave "
                             "data.datasets a share (sum below 1)")
        for i, point in enumerate(self.mixture_schedule):
            if len(point.weights) != len(self.datasets) or not sum(point.weights) > 0:
                raise ValueError(f"mixture_schedule[{i}].weights = {point.weights}: give one weight per dataset of "
                                 f"data.datasets ({len(self.datasets)}), none negative, summing to a positive number")
            if i and point.step <= self.mixture_schedule[i - 1].step:
                raise ValueError(f"mixture_schedule[{i}].step = {point.step} is not after the step before it "
                                 f"({self.mixture_schedule[i - 1].step}): list the points in increasing steps")
        warm = self.seq_len_warmup
        if warm is not None and (warm.start >= self.seq_len or self.seq_len % warm.start):
            raise ValueError(f"seq_len_warmup.start = {warm.start} must be below seq_len ({self.seq_len}) and divide "
                             "it: each window is cut into seq_len / start pieces")

    def sources(self) -> list[DatasetSource]:
        """``datasets`` then ``replay``, each replay set weighted so that it draws its ``share``."""
        rest = 1.0 - sum(r.share for r in self.replay)
        total = sum(d.weight for d in self.datasets)
        return [*self.datasets, *(r.as_source(r.share * total / rest) for r in self.replay)]

    @property
    def is_static(self) -> bool:
        """Whether every sample is drawn from the same mixture (no ``mixture_schedule``)."""
        return not self.mixture_schedule


def check_curriculum(cfg: LoaderConfig, max_steps: int, key: str = "data") -> None:
    """A ``ConfigError`` for a schedule step past ``max_steps`` (the run would never reach it), an
    ``InputError`` for a replay set that is not there; both name the key."""
    for i, point in enumerate(cfg.mixture_schedule):
        if point.step > max_steps:
            raise ConfigError(f"{key}.mixture_schedule[{i}].step = {point.step} is past train.max_steps = {max_steps}: "
                              "the run never reaches it")
    if cfg.seq_len_warmup is not None and cfg.seq_len_warmup.steps > max_steps:
        raise ConfigError(f"{key}.seq_len_warmup.steps = {cfg.seq_len_warmup.steps} is past train.max_steps = "
                          f"{max_steps}: the run would end before its rows reach data.seq_len")
    for i, r in enumerate(cfg.replay):
        if not (Path(r.path) / "manifest.json").is_file():
            raise InputError(f"{key}.replay[{i}].path = {r.path}: no prepared dataset there (no manifest.json); "
                             "give a directory written by `lmforge prepare`")


def mixture_weights(cfg: LoaderConfig, steps: np.ndarray) -> np.ndarray:
    """The probabilities ``(len(steps), len(cfg.sources()))`` of drawing each source at each step.

    The one definition of the mixture: ``data.datasets``' weights (or ``mixture_schedule``'s at the
    step, each point normalised to sum to 1) scaled to ``1 - Σ share``, then the replay shares.
    ``piecewise``: a point's weights hold from its step to the next point's; ``linear``: they move
    linearly from one point to the next. The datasets' own weights are the point at step 0 unless
    the schedule has one there; after the last point its weights hold.
    """
    steps = np.asarray(steps, dtype=np.int64)
    first = cfg.mixture_schedule[0].step if cfg.mixture_schedule else 1
    points = ([(0, [d.weight for d in cfg.datasets])] if first > 0 else []) + \
        [(p.step, p.weights) for p in cfg.mixture_schedule]
    at = np.array([step for step, _ in points], dtype=np.int64)
    table = np.array([np.asarray(w, dtype=np.float64) / sum(w) for _, w in points])
    last = np.searchsorted(at, steps, side="right") - 1
    probs = table[last]
    if cfg.mixture_interpolation == "linear" and len(points) > 1:
        nxt = np.minimum(last + 1, len(points) - 1)
        frac = np.where(nxt > last, (steps - at[last]) / np.maximum(at[nxt] - at[last], 1), 0.0)[:, None]
        probs = (1.0 - frac) * probs + frac * table[nxt]
    rest = 1.0 - sum(r.share for r in cfg.replay)
    shares = np.broadcast_to(np.array([r.share for r in cfg.replay], dtype=np.float64), (len(steps), len(cfg.replay)))
    return np.concatenate([rest * probs, shares], axis=1)


def piece_length(warmup: SeqLenWarmup | None, seq_len: int, step: int) -> int:
    """The row length of step ``step`` under ``seq_len_warmup``: the largest divisor of ``seq_len``
    at most ``start + (seq_len - start) * step / steps`` (so at least ``start``); ``seq_len`` from
    step ``steps`` on."""
    if warmup is None or step >= warmup.steps:
        return seq_len
    ramp = warmup.start + (seq_len - warmup.start) * step / warmup.steps
    return max(d for d in range(warmup.start, seq_len + 1) if seq_len % d == 0 and d <= ramp)


def cut_windows(rows: np.ndarray, length: int) -> np.ndarray:
    """``(B, seq_len + 1)`` windows as ``(B * seq_len / length, length + 1)`` rows, each window's
    pieces in order, overlapping by one token (a piece's last target is the next one's first
    input), so the batch keeps every target once: the same tokens and targets in shorter rows."""
    b, width = rows.shape
    starts = np.arange((width - 1) // length) * length
    return rows[:, starts[:, None] + np.arange(length + 1)].reshape(-1, length + 1)


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

    def window_scores(self) -> np.ndarray:
        """Each window's score: that of the document it starts in (``prepare``'s ``data.score_field``)."""
        if self.manifest.get("score_field") is None or any(s.scores is None for s in self.shards):
            raise InputError(f"{self.path / 'manifest.json'}: its documents have no scores, which data.score_order "
                             "orders by: prepare it with data.score_field naming the documents' score "
                             "(e.g. metadata.classifier_score of a curated corpus), or set data.score_order=none")
        out = np.empty(len(self), dtype=np.float64)
        for i, shard in enumerate(self.shards):
            mine = self.shard_of == i
            out[mine] = shard.scores[np.searchsorted(shard.doc_starts, self.start_of[mine], side="right") - 1]
        return out


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
        samples_per_step: int | None = None,
    ):
        if not cfg.datasets:
            raise InputError("no datasets configured for the loader")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.cfg, self.batch_size, self.rank, self.world_size, self.loop = cfg, batch_size, rank, world_size, loop
        self.samples_per_step = samples_per_step or batch_size * world_size
        self.mixture = cfg.sources()  # data.datasets, then the replay sets
        self.datasets = [TokenDataset(d.path, split, cfg.seq_len, cfg.bos_aligned, cfg.verify_shards) for d in self.mixture]
        if not loop and len(self.datasets) != 1:
            raise InputError("a non-looping (evaluation) loader reads exactly one dataset")
        hashes = {d.manifest["tokenizer_sha256"] for d in self.datasets}
        if len(hashes) > 1:
            raise InputError(f"datasets were tokenized with different tokenizers: {[str(d.path) for d in self.datasets]}")
        weights = np.array([d.weight for d in self.mixture], dtype=np.float64)
        self.cum_weights = np.cumsum(weights / weights.sum())
        self.cum_weights[-1] = 1.0
        self.scores = [d.window_scores() for d in self.datasets] if cfg.score_order != "none" else None
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self._drawn = np.zeros(len(self.datasets), dtype=np.int64)  # picks per dataset since pop_metrics
        self._score_sum, self._last_step = 0.0, 0
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
        if not self.cfg.shuffle and self.scores is None:
            return None
        key = (d, epoch)
        if key not in self._perm_cache:
            self._perm_cache = {k: v for k, v in self._perm_cache.items() if k[0] != d}
            n = len(self.datasets[d])
            order = np.random.default_rng([self.cfg.seed, d, epoch]).permutation(n) if self.cfg.shuffle else np.arange(n)
            if self.scores is not None:  # by score, ties in the seeded order (a stable sort keeps it)
                score = self.scores[d][order]
                order = order[np.argsort(score if self.cfg.score_order == "ascending" else -score, kind="stable")]
            self._perm_cache[key] = order
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
        """The dataset each global sample ``start .. stop - 1`` is drawn from: by the mixture's
        weights at the sample's step (``mixture_weights``)."""
        u = _uniform(self.cfg.seed, np.arange(start, stop))
        if self.cfg.is_static:
            return np.searchsorted(self.cum_weights, u, side="right")
        cum = np.cumsum(mixture_weights(self.cfg, np.arange(start, stop) // self.samples_per_step), axis=1)
        cum[:, -1] = 1.0
        return (u[:, None] >= cum).sum(axis=1)

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
        first = None
        while len(picks) < global_batch:
            kept = self.skipped.next_kept(self.samples)
            first = kept if first is None else first
            self._pass_over(self.samples, kept)
            stop = int(min(kept + global_batch - len(picks), self.skipped.next_skipped(kept)))
            picks += [(int(d), self._next_window(int(d))) for d in self._choices(kept, stop)]
            self.samples = stop
        step = int(first) // self.samples_per_step
        if self.loop:
            np.add.at(self._drawn, [d for d, _ in picks], 1)
            self._last_step = step
            if self.scores is not None:
                self._score_sum += float(sum(self.scores[d][w] for d, w in picks))
        length = piece_length(self.cfg.seq_len_warmup, self.cfg.seq_len, step) if self.loop else self.cfg.seq_len
        mine = picks[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        pieces = self.cfg.seq_len // length
        # the dataset of each row (DoReMi's domains), of each piece under seq_len_warmup
        self.sources = np.repeat(np.array([d for d, _ in mine], dtype=np.int64), pieces)
        if not mine:  # the last evaluation batch can leave a rank without rows
            return torch.zeros((0, self.cfg.seq_len + 1), dtype=torch.long)
        rows = np.stack([self.datasets[d].window(w) for d, w in mine]).astype(np.int64)
        return torch.from_numpy(rows if pieces == 1 else cut_windows(rows, length))

    def pop_metrics(self) -> dict[str, float]:
        """What the batches served since the last call drew (all ranks' rows): per dataset of a
        mixture its share of them (``data/drawn/<name>``) and its scheduled weight at the last
        one's step (``data/weight/<name>``); the row length under ``seq_len_warmup``
        (``data/seq_len``); the mean score of the windows under ``score_order`` (``data/score``)."""
        drawn, total, score, last = self._drawn, int(self._drawn.sum()), self._score_sum, self._last_step
        self._drawn, self._score_sum = np.zeros_like(drawn), 0.0
        if not total:
            return {}
        out: dict[str, float] = {}
        if len(self.mixture) > 1:
            weights = mixture_weights(self.cfg, np.array([last]))[0]
            for source, count, weight in zip(self.mixture, drawn.tolist(), weights.tolist()):
                out[f"data/drawn/{source.label}"] = count / total
                out[f"data/weight/{source.label}"] = weight
        if self.cfg.seq_len_warmup is not None:
            out["data/seq_len"] = float(piece_length(self.cfg.seq_len_warmup, self.cfg.seq_len, last))
        if self.scores is not None:
            out["data/score"] = score / total
        return out

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
