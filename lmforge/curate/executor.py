"""Where curation tasks run: in this process, on a local process pool, or on a Ray cluster.

An executor maps a picklable function over items and yields the results in order; the
same object is the ``pool_map`` that corpus steps use to fan out their ``resolve``. Ray
needs the run directory on storage every node sees (as datatrove's Ray executor does).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any


class LocalExecutor:
    """``workers`` processes (forked, so they share what the driver imported); 1 runs inline."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) if workers > 1 else None

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        if self.pool is None:
            return (fn(x) for x in items)
        return self.pool.map(fn, items)

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list:
        return list(self.imap(fn, items))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    return fn(item)


class RayExecutor:
    """One Ray task (1 CPU) per item. Joins ``address`` ("auto": the running cluster), or the
    Ray already initialised in this process, or starts a local one with ``workers`` CPUs."""

    def __init__(self, workers: int, address: str | None = None):
        import ray

        self.ray = ray
        self.owned = not ray.is_initialized()
        if self.owned:
            ray.init(address=address, num_cpus=None if address else workers, include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        self.task = ray.remote(num_cpus=1, max_retries=0)(_call)

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        refs = [self.task.remote(fn, x) for x in items]
        for ref in refs:
            try:
                yield self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else exc) from None

    def __call__(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list:
        return list(self.imap(fn, items))

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def make_executor(kind: str, workers: int, ray_address: str | None = None) -> LocalExecutor | RayExecutor:
    if kind == "ray":
        return RayExecutor(workers, ray_address)
    return LocalExecutor(workers)
