"""Aggregations, standard errors and pass@k, as lm-evaluation-harness defines them
(``lm_eval.api.metrics``), so a task's figures here and there are the same numbers.

A metric gives one item per document; its aggregation turns the items into the task's figure:

- ``mean``, ``median``, ``nanmean``;
- ``perplexity``: exp(-mean(ll)) over per-document log-likelihoods;
- ``weighted_perplexity``: exp(-Σ ll / Σ w) over (ll, w) items (w: words or bytes);
- ``bits_per_byte``: -Σ ll / Σ bytes / ln 2 over (ll, bytes) items.

The standard error follows the harness's ``stderr_for_metric``: the mean's closed form
(sample standard deviation / √n), a bootstrap of the aggregation for median, nanmean and
perplexity, none for the weighted ones (and none for a single item).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np


def mean(items: Sequence[float]) -> float:
    return sum(items) / len(items)


def median(items: Sequence[float]) -> float:
    """The harness's median: the upper middle item of the sorted list."""
    return sorted(items)[len(items) // 2]


def nanmean(items: Sequence[float]) -> float:
    if len(items) == 0 or all(np.isnan(items)):
        return float("nan")
    return float(np.nanmean(items))


def perplexity(items: Sequence[float]) -> float:
    return math.exp(-mean(items))


def weighted_mean(items: Sequence[tuple[float, float]]) -> float:
    a, b = zip(*items)
    return sum(a) / sum(b)


def weighted_perplexity(items: Sequence[tuple[float, float]]) -> float:
    return math.exp(-weighted_mean(items))


def bits_per_byte(items: Sequence[tuple[float, float]]) -> float:
    return -weighted_mean(items) / math.log(2)


AGGREGATIONS: dict[str, Callable] = {
    "mean": mean, "median": median, "nanmean": nanmean, "perplexity": perplexity,
    "weighted_perplexity": weighted_perplexity, "bits_per_byte": bits_per_byte,
}
BOOTSTRAPPED = {"median", "nanmean", "perplexity"}  # the harness's bootstrappable aggregations we have


def sample_stddev(items: Sequence[float]) -> float:
    mu = mean(items)
    return math.sqrt(sum((x - mu) ** 2 for x in items) / (len(items) - 1))


def mean_stderr(items: Sequence[float]) -> float:
    """s / √n, s the sample standard deviation (Bessel-corrected)."""
    return sample_stddev(items) / math.sqrt(len(items))


def bootstrap_stderr(f: Callable, items: Sequence, iters: int) -> float:
    """The sample standard deviation of ``f`` over ``iters`` resamples with replacement, drawn as
    the harness draws them: chunks of min(1000, iters) resamples, chunk i from ``random.Random(i)``
    (so the same items give the same figure in either program)."""
    chunk = min(1000, iters)
    replicates = []
    for i in range(iters // chunk):
        rnd = random.Random(i)
        replicates.extend(f(rnd.choices(items, k=len(items))) for _ in range(chunk))
    return sample_stddev(replicates)


def stderr(aggregation: str, items: Sequence, bootstrap_iters: int) -> float | None:
    """The harness's standard error of ``aggregation`` over ``items`` (None where it gives "N/A")."""
    if bootstrap_iters <= 0 or len(items) <= 1:
        return None
    if aggregation == "mean":
        return mean_stderr(items)
    if aggregation in BOOTSTRAPPED:
        return bootstrap_stderr(AGGREGATIONS[aggregation], items, bootstrap_iters)
    return None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021 (Codex, eq. 1) from ``n`` samples of
    which ``c`` pass: 1 - C(n-c, k) / C(n, k), computed as 1 - Π_{i=n-c+1..n} (1 - k/i) (their
    numerically stable form). Needs k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
