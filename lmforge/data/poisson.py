"""Poisson sampling of training rows, the sampling DP-SGD's privacy accounting assumes: each step
takes every row independently with probability q, so a batch's size varies (its mean is q N)."""

from __future__ import annotations

import numpy as np
import torch

from lmforge.core.io import InputError


class PoissonRowLoader:
    """Batches of a dict of (N, T) tensors, row i in step k's batch when the uniform draw
    ``default_rng([seed, k])`` gives it is below ``sample_rate``. Rank ``r`` of ``w`` takes every
    w-th of the step's rows from the r-th, so the ranks together hold the one process's batch.
    The state is the step count: resuming draws the batches an uninterrupted run would."""

    def __init__(self, rows: dict[str, torch.Tensor], sample_rate: float, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        self.rows, self.sample_rate, self.seed, self.rank, self.world_size = rows, sample_rate, seed, rank, world_size
        self.n = len(next(iter(rows.values())))
        if self.n == 0:
            raise InputError("no rows to load: the dataset is empty")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.step = 0

    def picks(self, step: int) -> np.ndarray:
        """The rows of step ``step``'s batch over every rank, in order."""
        return np.flatnonzero(np.random.default_rng([self.seed, step]).random(self.n) < self.sample_rate)

    def __iter__(self) -> PoissonRowLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        mine = torch.as_tensor(self.picks(self.step)[self.rank::self.world_size], dtype=torch.long)
        self.step += 1
        return {k: v[mine] for k, v in self.rows.items()}

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"step": self.step, "rows": self.n, "seed": self.seed, "sample_rate": self.sample_rate}

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows") != self.n or state.get("seed") != self.seed or "step" not in state:
            raise InputError(f"loader state {state} is not that of a Poisson sampler over {self.n} rows with seed "
                             f"{self.seed}: use a new run_dir")
        self.step = int(state["step"])
