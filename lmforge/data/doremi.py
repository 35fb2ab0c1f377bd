"""DoReMi's domain weights (Xie et al. 2023, "DoReMi: Optimizing Data Mixtures Speeds Up Language
Model Pretraining", Algorithm 1): the per-domain excess loss of a proxy over a reference, the
exponentiated-gradient step of Group DRO on it, the batches that carry each row's domain, and the
weights file a pre-training mixture reads (``data.weights_from``).

The proxy's loss under the weights is ``objectives.doremi``'s; the run is ``lmforge doremi``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from lmforge.core.io import InputError, atomic_write_json, reading
from lmforge.data.loader import LoaderConfig

WEIGHTS_FILE = "domain_weights.json"


def domain_excess_losses(excess: torch.Tensor, domains: torch.Tensor, n_domains: int,
                         previous: torch.Tensor) -> torch.Tensor:
    """λ of Algorithm 1: for each domain i, the clipped excess loss per token of its rows,

        λ[i] = Σ_{x ∈ B_i} Σ_j max(ℓ_θ,j(x) − ℓ_ref,j(x), 0) / Σ_{x ∈ B_i} |x|

    ``excess`` (B, T) is ℓ_proxy − ℓ_ref per target token, ``domains`` (B,) each row's domain. A
    domain with no row in the batch keeps its ``previous`` λ (as the reference implementation,
    sangmichaelxie/doremi, does), so its weight is not pulled toward uniform by an empty batch."""
    clipped = excess.detach().float().clamp_min(0)
    sums = torch.zeros(n_domains, dtype=torch.float64, device=clipped.device)
    counts = torch.zeros(n_domains, dtype=torch.float64, device=clipped.device)
    sums.index_add_(0, domains, clipped.sum(dim=1).double())
    counts.index_add_(0, domains, torch.full_like(domains, clipped.shape[1], dtype=torch.float64))
    present = counts > 0
    return torch.where(present, sums / counts.clamp_min(1), previous.to(sums))


def exponentiated_gradient_step(weights: torch.Tensor, excess: torch.Tensor, step_size: float,
                                smoothing: float) -> torch.Tensor:
    """Group DRO's weight update on the simplex (Algorithm 1, with u the uniform distribution):

        α' = softmax(log α + η·λ),   α ← (1 − c)·α' + c·u

    ``weights`` α (k,), ``excess`` λ (k,), ``step_size`` η (the paper's 1), ``smoothing`` c (1e-3)."""
    updated = torch.softmax(torch.log(weights) + step_size * excess, dim=0)
    return (1 - smoothing) * updated + smoothing / len(weights)


class DomainBatches:
    """A training ``TokenLoader`` whose batches also say each row's dataset: ``{"input_ids": (B,
    T + 1), "domains": (B,)}``. Its state is the loader's, so resume is the loader's exact resume."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self) -> DomainBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        tokens = next(self.loader)
        return {"input_ids": tokens, "domains": torch.from_numpy(self.loader.sources)}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str):  # samples, batch_size, skip_samples...: the loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def check_weights(weights: dict[str, float], where: str) -> dict[str, float]:
    """Weights by domain, normalised to sum to 1; an ``InputError`` naming ``where`` unless each is
    a finite number >= 0 and they sum to a positive number."""
    bad = {k: v for k, v in weights.items()
           if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0}
    if bad:
        name, value = next(iter(bad.items()))
        raise InputError(f"{where}: the weight of {name!r} is {value!r}; each must be a finite number >= 0")
    total = sum(weights.values())
    if not total > 0:
        raise InputError(f"{where}: the domain weights sum to {total}, not a positive number")
    return {k: v / total for k, v in weights.items()}


def write_domain_weights(path: Path, weights: dict[str, float], **details) -> None:
    """``domain_weights.json``: ``weights`` (the mixture a pre-training recipe reads) and what made them."""
    atomic_write_json(path, {"weights": weights, **details})


def read_domain_weights(path: str | Path) -> dict[str, float]:
    """The ``weights`` of a domain-weights file, by domain name, normalised to sum to 1."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data.weights_from: {path} not found (write it with `lmforge doremi`)")
    with reading(path):
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"data.weights_from: {path} is not JSON ({exc})") from exc
    weights = data.get("weights") if isinstance(data, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise InputError(f"data.weights_from: {path} has no 'weights' mapping of domain name to weight")
    return check_weights(weights, f"data.weights_from: {path}")


def apply_domain_weights(data: LoaderConfig) -> LoaderConfig:
    """``data`` with each dataset's weight taken from ``data.weights_from`` by its name (``label``);
    unchanged without it. Every dataset must have a weight there, and every weight a dataset."""
    if data.weights_from is None:
        return data
    weights = read_domain_weights(data.weights_from)
    names = [d.label for d in data.datasets]
    missing = [n for n in names if n not in weights]
    extra = sorted(set(weights) - set(names))
    if missing or extra:
        raise InputError(f"data.weights_from: {data.weights_from} names the domains {sorted(weights)}, but data.datasets "
                         f"are {names}" + (f": {missing} missing" if missing else "")
                         + (f"; {extra} unknown" if extra else "") + " (a dataset's name is its `name:` or directory)")
    if any(weights[n] <= 0 for n in names):
        zero = [n for n in names if weights[n] <= 0]
        raise InputError(f"data.weights_from: {data.weights_from} gives {zero} weight 0; a mixture's datasets each need "
                         "a positive weight (leave the dataset out instead)")
    datasets = [dataclasses.replace(d, weight=weights[d.label]) for d in data.datasets]
    return dataclasses.replace(data, datasets=datasets)
