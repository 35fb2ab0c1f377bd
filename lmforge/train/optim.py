"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weight matrices of linear layers; none on norms, biases or embeddings."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # shared (tied) parameters appear once
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in embedding_params:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019); the fused kernel where the device has one."""
    device = next(model.parameters()).device
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)


def lr_at(
    step: int,
    *,
    peak: float,
    max_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    - ``cosine``: linear warm-up to ``peak``, then cosine decay to ``min_lr_ratio * peak``
      at ``max_steps`` (Loshchilov & Hutter 2017; the Chinchilla/Llama recipe).
    - ``wsd``: warm-up, stable at ``peak``, then linear decay to the minimum over the
      last ``decay_fraction`` of the steps (warmup-stable-decay, Hu et al. 2024, MiniCPM).
    - ``constant``: warm-up, then ``peak``.
    """
    minimum = peak * min_lr_ratio
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    if schedule == "cosine":
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max_steps))
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / decay_steps)
        return peak + (minimum - peak) * progress
    raise ValueError(f"unknown schedule {schedule!r}; use cosine, wsd or constant")
