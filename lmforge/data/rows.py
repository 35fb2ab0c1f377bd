"""A stateful loader over pre-built rows (packed or padded SFT examples, preference pairs...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lmforge.core.io import InputError
from lmforge.data.skipped import SkippedSamples

if TYPE_CHECKING:
    from lmforge.data.replay import RowGroups


class RowLoader:
    """Micro-batches of rows of a dict of (N, T) tensors, shuffled per epoch from a seed.

    Like ``TokenLoader``: rank ``r`` of ``w`` takes rows ``[r*B, (r+1)*B)`` of each global
    batch, ``loop=True`` cycles epochs, ``state_dict()`` (epoch, position) resumes exactly, and
    ``skip_samples`` passes over rows of the global stream (numbered ``epoch * N + position``).
    """

    def __init__(self, rows: dict[str, torch.Tensor], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 loop: bool = True, rank: int = 0, world_size: int = 1, groups: RowGroups | None = None):
        self.rows, self.batch_size, self.seed, self.shuffle, self.loop = rows, batch_size, seed, shuffle, loop
        self.groups = groups  # which group each row is of (sft's replay), for the shares drawn
        self._drawn = np.zeros(len(groups.names) if groups is not None else 0, dtype=np.int64)
        self.rank, self.world_size = rank, world_size
        self.n = len(next(iter(rows.values())))
        if self.n == 0:
            raise InputError("no rows to load: the dataset is empty")
        self.epoch, self.pos = 0, 0
        self.skipped = SkippedSamples()

    @property
    def samples(self) -> int:
        """Global rows consumed by all ranks together, skipped ones included."""
        return self.epoch * self.n + self.pos

    def skip_samples(self, start: int, stop: int) -> None:
        """Never serve rows ``start .. stop - 1`` of the global stream (a training loader only)."""
        if not self.loop:
            raise ValueError("only a training (looping) loader can skip samples")
        self.skipped.add(start, stop)

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def __iter__(self) -> RowLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        global_batch = self.batch_size * self.world_size
        picks: list[int] = []
        while len(picks) < global_batch:
            kept = self.skipped.next_kept(self.samples)
            if kept > self.samples:
                self.epoch, self.pos = divmod(kept, self.n)
            if self.pos >= self.n:
                if not self.loop:
                    break
                self.epoch, self.pos = self.epoch + 1, 0
            order = self._order()
            take = int(min(global_batch - len(picks), self.n - self.pos, self.skipped.next_skipped(kept) - kept))
            picks += order[self.pos : self.pos + take].tolist()
            self.pos += take
        if not picks:
            raise StopIteration
        if self.groups is not None:
            np.add.at(self._drawn, self.groups.of_row[picks], 1)
        mine = torch.as_tensor(picks[self.rank * self.batch_size : (self.rank + 1) * self.batch_size], dtype=torch.long)
        return {k: v[mine] for k, v in self.rows.items()}

    def __len__(self) -> int:
        return self.n

    def pop_metrics(self) -> dict[str, float]:
        """With ``groups``: each group's share of the rows served (all ranks') since the last call
        (``data/drawn/<name>``), what metrics.jsonl logs per step."""
        total = int(self._drawn.sum())
        if self.groups is None or not total:
            return {}
        drawn, self._drawn = self._drawn, np.zeros_like(self._drawn)
        return {f"data/drawn/{name}": count / total for name, count in zip(self.groups.names, drawn.tolist())}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "rows": self.n, "seed": self.seed,
                "skipped": self.skipped.to_list()}

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != self.n or state["seed"] != self.seed:
            raise InputError(f"loader state is for {state['rows']} rows with seed {state['seed']}, "
                             f"this data has {self.n} rows with seed {self.seed}: use a new run_dir")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.skipped = SkippedSamples(state.get("skipped"))  # absent from states saved before skipping existed
