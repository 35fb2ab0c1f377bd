"""DoReMi's proxy objective (Xie et al. 2023, Algorithm 1): the causal LM loss of the proxy, each
domain weighted by Group DRO's domain weights α, which move toward the domains where the proxy's
loss most exceeds a frozen reference model's.

Each training micro-batch (``data.doremi.DomainBatches``: rows and their domains) first updates α
from its excess losses (``data.doremi``: λ, then the exponentiated-gradient step), then returns the
proxy's loss under the new α, as Algorithm 1 orders one step; with several micro-batches a step,
α moves once per micro-batch. The output of a DoReMi run is ᾱ, the mean of α over its updates.
α, λ and ᾱ are the objective's state, saved in every checkpoint (``Objective.state_dict``), so a
resumed run continues them exactly. Validation batches (plain token windows) get the plain loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import positive, unit_interval
from lmforge.core.io import InputError
from lmforge.data.doremi import domain_excess_losses, exponentiated_gradient_step
from lmforge.data.packing import IGNORE_INDEX
from lmforge.objectives.base import LossOutput, Objective
from lmforge.objectives.clm import CausalLMObjective


@dataclass
class DoReMiConfig:
    """Group DRO's step on the domain weights."""

    step_size: float = positive(1.0, help="η, the exponentiated-gradient step size on the excess losses (the paper's 1)")
    smoothing: float = unit_interval(
        1e-3, high_open=True, help="c: each update mixes the weights with uniform, (1 − c)·α + c/k (the paper's 1e-3)"
    )


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood of each target (B, T), in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)


def dro_weighted_loss(losses: torch.Tensor, domains: torch.Tensor, weights: torch.Tensor,
                      sampling: torch.Tensor) -> torch.Tensor:
    """The summed proxy loss of Algorithm 1 under domain weights α, for rows drawn by the mixture s:

        Σ_t (α_{d(t)} / s_{d(t)}) · ℓ_θ,t        whose mean per token estimates  L(θ, α) = Σ_i α_i · ℓ̄_i

    (ℓ̄_i the proxy's loss per token on domain i; the reference's loss, constant in θ, is left out).
    ``losses`` (B, T), ``domains`` (B,), ``weights`` α and ``sampling`` s (k,). A token of domain i is
    drawn with probability s_i, so dividing by s_i makes the estimate unbiased for any sampling
    mixture; each token's weight is fixed in the step, so the loop's division by the step's target
    count keeps it exact under accumulation."""
    per_row = (weights / sampling).to(losses)[domains]
    return (losses.sum(dim=1) * per_row).sum()


class DoReMiObjective(Objective):
    """The proxy's DRO-weighted loss against ``reference`` (frozen, same tokenizer) over ``names``
    domains drawn by the mixture ``sampling``; α starts uniform (Algorithm 1's α_0 = u)."""

    def __init__(self, reference: nn.Module, names: list[str], sampling: list[float], cfg: DoReMiConfig,
                 token_bytes: torch.Tensor | None = None):
        self.reference, self.names, self.cfg = reference.eval().requires_grad_(False), list(names), cfg
        k = len(names)
        total = float(sum(sampling))
        self.sampling = torch.tensor([s / total for s in sampling], dtype=torch.float64)
        self.weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
        self.excess = torch.zeros(k, dtype=torch.float64)
        self.average = torch.zeros(k, dtype=torch.float64)
        self.updates = 0
        self.plain = CausalLMObjective(token_bytes)

    def num_targets(self, batch) -> int:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        return ids.shape[0] * (ids.shape[1] - 1)

    def update(self, excess: torch.Tensor, domains: torch.Tensor) -> None:
        """Algorithm 1's steps on one batch: λ from its excess losses, α, and the running mean ᾱ."""
        self.excess = domain_excess_losses(excess, domains, len(self.names), self.excess).cpu()
        self.weights = exponentiated_gradient_step(self.weights, self.excess, self.cfg.step_size, self.cfg.smoothing)
        self.updates += 1
        self.average += (self.weights - self.average) / self.updates

    def __call__(self, model: nn.Module, batch) -> LossOutput:
        if not isinstance(batch, dict):  # a validation window: the proxy's plain loss
            return self.plain(model, batch)
        ids, domains = batch["input_ids"], batch["domains"]
        inputs, targets = ids[:, :-1], ids[:, 1:]
        losses = token_losses(model(inputs), targets)
        n = self.num_targets(ids)
        if torch.is_grad_enabled():
            with torch.no_grad():
                reference_losses = token_losses(self.reference(inputs), targets)
            self.update(losses.detach() - reference_losses, domains)
        loss = dro_weighted_loss(losses, domains, self.weights.to(losses.device), self.sampling.to(losses.device))
        metrics = {}
        for i, name in enumerate(self.names):  # logged as their mean per target: the value itself
            metrics[f"doremi/weight/{name}"] = torch.tensor(float(self.weights[i]) * n)
            metrics[f"doremi/excess/{name}"] = torch.tensor(float(self.excess[i]) * n)
        return LossOutput(loss, n, metrics=metrics)

    def domain_weights(self) -> dict[str, float]:
        """ᾱ by domain name: DoReMi's output (the current α before any update)."""
        weights = self.average if self.updates else self.weights
        return {name: float(w) for name, w in zip(self.names, weights)}

    def state_dict(self) -> dict:
        return {"names": self.names, "weights": self.weights.tolist(), "excess": self.excess.tolist(),
                "average": self.average.tolist(), "updates": self.updates}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        if state.get("names") != self.names:
            raise InputError(f"the checkpoint's DoReMi domains are {state.get('names')}, this run's {self.names}: "
                             "use a new run_dir or train.resume=never")
        self.weights, self.excess, self.average = (torch.tensor(state[k], dtype=torch.float64)
                                                   for k in ("weights", "excess", "average"))
        self.updates = int(state["updates"])
