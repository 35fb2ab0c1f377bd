"""Muon (Jordan et al. 2024): the momentum of each hidden matrix, orthogonalised by a Newton-Schulz
iteration, is the update; every other parameter (embeddings, the head, norms, biases) is trained
by AdamW in the same optimizer, as nanochat and modded-nanogpt split them.

Which parameters are "hidden matrices" is one rule, ``is_hidden_matrix``: a 2-D parameter of a
transformer block (``layers.<i>.``) that is not an embedding table. It holds for every family
(the blocks' projections; with LoRA, the adapters' A and B) and leaves the input and output
layers, whose rows are tokens rather than directions of the residual stream, to AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

from lmforge.core.config import ConfigError, at_least, check_ranges, in_range, option, positive, unit_interval

# Jordan et al.'s quintic, the same coefficients at every step (chosen for the steepest slope at 0)
JORDAN_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel et al. 2025), one triple per step, for 5 steps (as nanochat uses them)
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class MuonConfig:
    """``train.muon``: the Muon half of ``train.optimizer: muon`` (AdamW's keys train the rest)."""

    lr: float = positive(0.02, help="peak learning rate of the hidden matrices (the schedule scales it as train.lr)")
    momentum: float = unit_interval(0.95, high_open=True, help="momentum β of the update's running average")
    nesterov: bool = option(True, help="orthogonalise the Nesterov look-ahead g + β(m - g) instead of m")
    ns_steps: int = in_range(5, 1, 10, help="Newton-Schulz iterations (polar_express: at most 5)")
    coefficients: Literal["jordan", "polar_express"] = option(
        "jordan",
        help="jordan: the quintic (3.4445, -4.7750, 2.0315) at every step (Jordan et al. 2024); "
        "polar_express: per-step coefficients (Amsel et al. 2025)",
    )
    ns_dtype: Literal["bf16", "fp32"] = option("bf16", help="dtype the iteration runs in")
    weight_decay: float = at_least(0, 0.0, help="decoupled decay of the hidden matrices: w <- w (1 - lr wd)")
    scale: Literal["shape", "adamw_rms"] = option(
        "shape",
        help="the update's scale: shape = sqrt(max(1, rows / cols)) (Jordan et al.); adamw_rms = "
        "0.2 sqrt(max(rows, cols)), an update of AdamW's RMS, so AdamW's lr and decay carry over (Liu et al. 2025)",
    )

    def __post_init__(self) -> None:
        check_ranges(self, "train.muon.")
        if self.coefficients == "polar_express" and self.ns_steps > len(POLAR_EXPRESS_COEFFICIENTS):
            raise ValueError(f"train.muon.ns_steps = {self.ns_steps}: polar_express has coefficients for at most "
                             f"{len(POLAR_EXPRESS_COEFFICIENTS)} steps")


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: str = "jordan",
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An approximate orthogonalisation ``U Vᵀ`` of a matrix ``G = U S Vᵀ`` (Jordan et al. 2024).

    ``X₀ = G / (‖G‖_F + 1e-7)``, then ``steps`` times ``A = X Xᵀ``, ``X ← a X + (b A + c A²) X``:
    an odd quintic in the singular values, which pushes each of them towards 1 (to about
    0.7-1.2 with Jordan's coefficients, which trade exactness for speed). A tall matrix is
    transposed first, so ``A`` is the smaller Gram matrix. Polar Express (Amsel et al. 2025)
    uses one coefficient triple per step and starts from ``G / (1.01 ‖G‖_F + 1e-6)``. The result
    has ``G``'s shape and dtype.
    """
    if coefficients == "jordan":
        schedule, x = [JORDAN_COEFFICIENTS] * steps, g.to(dtype)
        x = x / (x.norm() + 1e-7)
    elif coefficients == "polar_express":
        schedule, x = POLAR_EXPRESS_COEFFICIENTS[:steps], g.to(dtype)
        x = x / (x.norm() * 1.01 + 1e-6)
    else:
        raise ValueError(f"unknown Newton-Schulz coefficients {coefficients!r}; use jordan or polar_express")
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    for a, b, c in schedule:  # addmm: each sum of products rounds once (in bf16, half the error of separate ops)
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(g.dtype)


def update_scale(shape: torch.Size, scale: str) -> float:
    """The factor on the orthogonalised update of a ``rows x cols`` matrix (``MuonConfig.scale``)."""
    rows, cols = shape[-2], shape[-1]
    return max(1.0, rows / cols) ** 0.5 if scale == "shape" else 0.2 * max(rows, cols) ** 0.5


def orthogonalised(update: torch.Tensor, steps: int, coefficients: str, dtype: torch.dtype) -> torch.Tensor:
    """``newton_schulz`` of a whole matrix. A sharded one (a DTensor: FSDP2, tensor parallelism)
    is gathered, orthogonalised on every rank alike, and this rank's shard is kept (the iteration
    mixes every row with every other, so it cannot run shard by shard)."""
    if not isinstance(update, DTensor):
        return each_matrix(update, steps, coefficients, dtype)
    full = each_matrix(update.full_tensor(), steps, coefficients, dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


def each_matrix(update: torch.Tensor, steps: int, coefficients: str, dtype: torch.dtype) -> torch.Tensor:
    """``newton_schulz`` of a matrix, or of each matrix of a stack (a mixture's experts, (E, out, in)):
    every expert's weight is a matrix of its own, orthogonalised alone (Moonlight's Muon for MoE)."""
    if update.ndim == 2:
        return newton_schulz(update, steps, coefficients, dtype)
    return torch.stack([newton_schulz(m, steps, coefficients, dtype) for m in update.unbind(0)])


def is_hidden_matrix(name: str, param: nn.Parameter, embeddings: set[int]) -> bool:
    """Whether Muon trains ``param`` (named ``name`` in the model): a 2-D parameter of a block
    (a name with a ``layers`` part, as ``layers.3.attn.wq.weight`` or, with LoRA,
    ``layers.0.mlp.w1.lora_A``) that is not an embedding table, or a block's stack of such matrices
    (``model.moe``'s experts, ``layers.1.mlp.experts.w1``: (E, out, in), each expert's its own)."""
    stacked = param.ndim == 3 and ".experts." in f".{name}"
    return (param.ndim == 2 or stacked) and id(param) not in embeddings and "layers" in name.split(".")[:-1]


class Muon(torch.optim.Optimizer):
    """Muon on the groups whose ``kind`` is ``"muon"``, AdamW on those whose ``kind`` is ``"adamw"``.

    For a hidden matrix ``W`` with gradient ``G`` (Jordan et al. 2024, with decoupled decay):

        M ← β M + (1 - β) G                     (momentum; ``lerp``)
        U = G + β (M - G)  (Nesterov)  or  U = M
        W ← W (1 - η λ) - η · s · NS(U)         (``NS``: ``newton_schulz``; ``s``: ``update_scale``)

    The AdamW groups run ``torch.optim.adamw.adamw`` (the fused kernel where the device has one),
    with AdamW's state (``step``, ``exp_avg``, ``exp_avg_sq``), so their arithmetic is
    ``torch.optim.AdamW``'s. Each group's ``peak_lr`` is what the schedule scales.
    """

    def __init__(self, groups: list[dict], *, fused: bool = False):
        for group in groups:
            if group.get("kind") not in ("muon", "adamw"):
                raise ValueError(f"a Muon parameter group's kind is muon or adamw, not {group.get('kind')!r}")
        super().__init__(groups, defaults={})
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        beta, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        dtype = NS_DTYPES[group["ns_dtype"]]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            update = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            direction = orthogonalised(update, group["ns_steps"], group["coefficients"], dtype)
            if decay:
                p.mul_(1 - lr * decay)
            p.add_(direction, alpha=-lr * update_scale(p.shape, group["scale"]))

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self.fused else None)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None if self.fused else True,
              fused=self.fused or None, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


def hidden_matrix_names(model: nn.Module) -> dict[str, int]:
    """Name -> id of each trainable parameter ``is_hidden_matrix`` picks (a tied one once)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {name: id(p) for name, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(name, p, embeddings)}


def hidden_matrices(model: nn.Module) -> set[int]:
    """The ids of the trainable parameters Muon trains (``is_hidden_matrix``); a ``ConfigError``
    when there are none (``prepare_model`` asks before a stage does any work)."""
    hidden = set(hidden_matrix_names(model).values())
    if not hidden:
        raise ConfigError("train.optimizer = muon: the model has no trainable 2-D matrix in its blocks for Muon to "
                          "orthogonalise (use adamw or lamb)")
    return hidden


def muon_groups(model: nn.Module, muon: MuonConfig, adamw: list[dict], betas: tuple[float, float], eps: float,
                lr: float, muon_lr: float | None = None) -> list[dict]:
    """The hidden matrices as one Muon group (at ``muon_lr``, default ``muon.lr``) and ``adamw``
    (``optim.param_groups``'s groups) less those matrices as AdamW groups; empty groups are dropped.
    Raises ``ConfigError`` when the model has no hidden matrix to train."""
    hidden = hidden_matrices(model)
    matrices = [p for group in adamw for p in group["params"] if id(p) in hidden]
    rate = muon.lr if muon_lr is None else muon_lr
    groups = [{"kind": "muon", "params": matrices, "lr": rate, "peak_lr": rate, "momentum": muon.momentum,
               "nesterov": muon.nesterov, "ns_steps": muon.ns_steps, "coefficients": muon.coefficients,
               "ns_dtype": muon.ns_dtype, "weight_decay": muon.weight_decay, "scale": muon.scale}]
    for group in adamw:
        rest = [p for p in group["params"] if id(p) not in hidden]
        if rest:
            groups.append({"kind": "adamw", "params": rest, "lr": lr, "peak_lr": lr, "betas": betas, "eps": eps,
                           "weight_decay": group["weight_decay"]})
    return groups
