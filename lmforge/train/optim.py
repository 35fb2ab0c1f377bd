"""The optimizer a run names (``train.optimizer``: AdamW, Muon with AdamW, LAMB), with weight
decay on matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmforge.core.config import ConfigError
from lmforge.model.transformer import Transformer
from lmforge.train.lamb import Lamb
from lmforge.train.muon import Muon, hidden_matrix_names, muon_groups

if TYPE_CHECKING:
    from lmforge.train.loop import TrainConfig


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


def width_mult(model: nn.Module, optimizer: str) -> float:
    """µP's width multiplier ``m`` of the transformer in ``model`` (``model.mup``; 1 without it). A
    ``ConfigError`` for ``lamb``: µP's learning-rate table is Adam's and Muon's, and LAMB's trust
    ratio sets each tensor's step from its own norm instead."""
    mults = {m.cfg.width_mult() for m in model.modules() if isinstance(m, Transformer)}
    mult = mults.pop() if len(mults) == 1 else 1.0
    check_mup_optimizer(mult, optimizer)
    return mult


def check_mup_optimizer(mult: float, optimizer: str) -> None:
    """A ``ConfigError`` for µP (width multiplier ``mult`` other than 1) under LAMB (``width_mult``)."""
    if mult != 1.0 and optimizer == "lamb":
        raise ConfigError("model.mup is set with train.optimizer = lamb: µP's learning rates are defined for adamw and "
                          "muon (LAMB's trust ratio scales each tensor's step itself); use adamw or muon, or unset model.mup")


def mup_groups(model: nn.Module, groups: list[dict], lr: float, mult: float) -> list[dict]:
    """``groups`` with the hidden matrices (``muon.is_hidden_matrix``: the blocks' 2-D weights) in
    groups of their own at µP's Adam rate ``lr / m`` (Yang et al. 2021, Table 8: a matrix both of
    whose dimensions grow with width); the rest keep ``lr``. LoRA's factors have one dimension that
    grows (the other is the rank), so they keep ``lr``, as do embeddings, the head, norms and biases.
    Every group holds its ``peak_lr``."""
    hidden = {pid for name, pid in hidden_matrix_names(model).items()
              if not any(part.startswith("lora_") for part in name.split("."))}
    out = []
    for group in groups:
        for ps, rate in (([p for p in group["params"] if id(p) in hidden], lr / mult),
                         ([p for p in group["params"] if id(p) not in hidden], lr)):
            if ps:
                out.append({**group, "params": ps, "lr": rate, "peak_lr": rate})
    return out


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.optimizer`` over ``model``'s trainable parameters.

    - ``adamw``: ``build_adamw`` with ``train.lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``.
    - ``muon``: ``Muon`` with ``train.muon``'s keys on the blocks' 2-D matrices, and AdamW with
      the keys above on the rest (embeddings, the head, norms, biases).
    - ``lamb``: ``Lamb`` with the keys above and ``train.lamb``'s on every parameter.

    Under µP (``model.mup``, width multiplier ``m``) AdamW trains the hidden matrices at ``lr / m``
    (``mup_groups``); Muon's matrices keep ``train.muon.lr`` with the ``shape`` scale, whose
    orthogonalised update of spectral norm ~√(fan_out / fan_in) is already µP's (Yang, Simon &
    Bernstein 2023), and take ``lr / m`` with ``adamw_rms``, whose update has AdamW's RMS.

    Every group holds ``peak_lr``, the rate the schedule scales (``loop.scheduled_lr``).
    """
    betas = (cfg.beta1, cfg.beta2)
    mult = width_mult(model, cfg.optimizer)
    device = next(model.parameters()).device
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "adamw":
        if mult == 1.0:
            return build_adamw(model, cfg.lr, betas, cfg.eps, cfg.weight_decay)
        return torch.optim.AdamW(mup_groups(model, param_groups(model, cfg.weight_decay), cfg.lr, mult), lr=cfg.lr,
                                 betas=betas, eps=cfg.eps, fused=fused)
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "muon":
        muon_lr = cfg.muon.lr / mult if cfg.muon.scale == "adamw_rms" else cfg.muon.lr
        return Muon(muon_groups(model, cfg.muon, groups, betas, cfg.eps, cfg.lr, muon_lr=muon_lr), fused=fused)
    if cfg.optimizer == "lamb":
        lamb = cfg.lamb
        return Lamb([{**g, "peak_lr": cfg.lr} for g in groups], lr=cfg.lr, betas=betas, eps=cfg.eps,
                    bias_correction=lamb.bias_correction, max_weight_norm=lamb.max_weight_norm,
                    max_trust_ratio=lamb.max_trust_ratio)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; use adamw, muon or lamb")


def lr_at(
    step: int,
    *,
    peak: float,
    max_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
    warmup_start: float = 0.0,
) -> float:
    """Learning rate of the optimizer step taken after ``step`` steps have run.

    The loop calls ``lr_at(step)`` for ``step = 0 .. max_steps - 1``; the step it takes is
    number ``n = step + 1`` (1-based, the ``step`` that metrics.jsonl records), so the
    first step runs at ``lr_at(0)`` and the last at ``lr_at(max_steps - 1)``. With
    ``W = warmup_steps``, ``T = max_steps``, ``min = min_lr_ratio * peak``:

    - warm-up, ``n <= W``: ``s + (peak - s) * n / W`` from ``s = warmup_start`` (0 by default;
      continued pre-training's re-warming from the previous run's final rate, Ibrahim et al. 2024,
      "Simple and Scalable Strategies to Continually Pre-train Large Language Models"), so
      step ``W`` is the first at ``peak``; the decay after it re-decays to ``min``.
    - ``cosine``, ``W < n <= T``: ``min + (peak - min) * (1 + cos(pi * (n - W) / (T - W))) / 2``
      (Loshchilov & Hutter 2017; the Chinchilla/Llama recipe).
    - ``wsd``: ``peak`` up to step ``S = T - D``, then ``min + (peak - min) * (T - n) / D`` over
      the last ``D = max(1, round(decay_fraction * T))`` steps (warmup-stable-decay, Hu et al.
      2024, MiniCPM); when warm-up and decay would overlap, the decay starts after warm-up.
    - ``constant``: ``peak`` after warm-up.

    Every decay step that runs is below ``peak`` and step ``T``, the last, is exactly at
    ``min``. This is nanoGPT's ``get_lr(it)`` with ``it = n`` (its loop runs
    ``it = 0 .. max_iters``, one step more than asked, the last at ``min_lr``) without its
    extra step 0; torchtitan's decay, ``(n - S) / (D + 1)``, stops one step short of the
    minimum. The rate is a pure function of the step, so a resumed run follows the same
    schedule.
    """
    n = step + 1
    minimum = peak * min_lr_ratio
    if warmup_steps > 0 and n <= warmup_steps:
        return warmup_start + (peak - warmup_start) * n / warmup_steps
    if schedule == "constant":
        return peak
    if schedule == "cosine":
        progress = min(1.0, (n - warmup_steps) / max(1, max_steps - warmup_steps))
        return minimum + 0.5 * (peak - minimum) * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = max(warmup_steps, max_steps - max(1, round(decay_fraction * max_steps)))
        if n <= decay_start:
            return peak
        remaining = max(0, max_steps - n) / max(1, max_steps - decay_start)
        return minimum + (peak - minimum) * remaining
    raise ValueError(f"unknown schedule {schedule!r}; use cosine, wsd or constant")
