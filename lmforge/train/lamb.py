"""LAMB (You et al. 2019): Adam's moments with a per-tensor trust ratio, for large batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from lmforge.core.config import check_ranges, option, positive


@dataclass
class LambConfig:
    """``train.lamb``: LAMB's own keys (its lr, betas, ε and weight decay are train.lr, beta1, beta2, eps,
    weight_decay)."""

    bias_correction: bool = option(True, help="divide the moments by 1 - β^t (Adam's bias correction)")
    max_weight_norm: float | None = positive(
        None, help="φ(‖w‖) = min(‖w‖, this) in the trust ratio (torch-optimizer's clamp_value); None: ‖w‖ itself"
    )
    max_trust_ratio: float | None = positive(
        None, help="clip the trust ratio to at most this (timm's trust_clip is 1.0); None: unclipped"
    )

    def __post_init__(self) -> None:
        check_ranges(self, "train.lamb.")


def norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖₂ of the whole tensor, also of a sharded one (its shards' norms reduced over the mesh)."""
    n = torch.linalg.vector_norm(t)
    return n.full_tensor() if isinstance(n, DTensor) else n


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Lamb(torch.optim.Optimizer):
    """LAMB, Algorithm 2 of You et al. 2019, for each parameter tensor ``x`` with gradient ``g``:

        m ← β₁ m + (1 - β₁) g,   v ← β₂ v + (1 - β₂) g²
        m̂ = m / (1 - β₁ᵗ),      v̂ = v / (1 - β₂ᵗ)          (``bias_correction``)
        r = m̂ / (√v̂ + ε) + λ x
        x ← x - η · φ(‖x‖) / ‖r‖ · r

    with ``φ(z) = min(z, max_weight_norm)`` and the ratio ``φ(‖x‖) / ‖r‖`` taken as 1 when either
    norm is 0, then clipped to at most ``max_trust_ratio`` when one is set. Each parameter group
    may set its own ``weight_decay`` λ (``optim.param_groups``: none on norms, biases, embeddings).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, max_weight_norm: float | None = None,
                 max_trust_ratio: float | None = None):
        if max_weight_norm is not None and max_weight_norm <= 0:
            raise ValueError(f"LAMB's max_weight_norm must be > 0, got {max_weight_norm}")
        if max_trust_ratio is not None and max_trust_ratio <= 0:
            raise ValueError(f"LAMB's max_trust_ratio must be > 0, got {max_trust_ratio}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_weight_norm=max_weight_norm, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                m, v, g, x = local(state["exp_avg"]), local(state["exp_avg_sq"]), local(p.grad), local(p)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if group["bias_correction"]:
                    r = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt_().add_(group["eps"]))
                else:
                    r = m / v.sqrt().add_(group["eps"])
                if group["weight_decay"]:
                    r.add_(x, alpha=group["weight_decay"])
                ratio = self.trust_ratio(p, r, group)
                x.add_(r * ratio, alpha=-group["lr"])
        return loss

    @staticmethod
    def trust_ratio(p: torch.Tensor, r_local: torch.Tensor, group: dict) -> torch.Tensor:
        """``φ(‖x‖) / ‖r‖`` (1 when either is 0), clipped to ``max_trust_ratio``; norms of whole tensors."""
        r = DTensor.from_local(r_local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()) \
            if isinstance(p, DTensor) else r_local
        w_norm, r_norm = norm(p), norm(r)
        if group["max_weight_norm"] is not None:
            w_norm = w_norm.clamp(max=group["max_weight_norm"])
        ratio = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))
        if group["max_trust_ratio"] is not None:
            ratio = ratio.clamp(max=group["max_trust_ratio"])
        return ratio
