"""Sample indices a training loader never serves: the batches a loss-spike rollback skips.

A training loader numbers the samples of its global stream 0, 1, 2, ...; a skipped range
``[start, stop)`` of those numbers is passed over as if it had been served, so every other
sample keeps its place in the stream. The ranges are part of the loader's ``state_dict()``,
so a run resumed after a rollback skips the same samples.
"""

from __future__ import annotations

import math


class SkippedSamples:
    """Sorted, merged half-open ranges ``[start, stop)`` of global sample indices."""

    def __init__(self, ranges: list[list[int]] | None = None):
        self.ranges: list[tuple[int, int]] = []
        for start, stop in ranges or []:
            self.add(int(start), int(stop))

    def add(self, start: int, stop: int) -> None:
        """Skip samples ``start .. stop - 1``; overlapping or touching ranges merge."""
        if not 0 <= start < stop:
            raise ValueError(f"a skipped sample range needs 0 <= start < stop, got [{start}, {stop})")
        merged = []
        for a, b in sorted([*self.ranges, (start, stop)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.ranges = merged

    def next_kept(self, index: int) -> int:
        """The first sample at or after ``index`` that is not skipped."""
        for a, b in self.ranges:
            if a <= index < b:
                return b
        return index

    def next_skipped(self, index: int) -> float:
        """Where the first skipped range at or after ``index`` starts (infinity if none)."""
        return next((a for a, _ in self.ranges if a >= index), math.inf)

    def to_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]
