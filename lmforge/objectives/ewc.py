"""Elastic weight consolidation: a quadratic pull towards an earlier task's weights, added to
any stage's objective (Kirkpatrick et al. 2017), and its online form (EWC++).

    L(θ) = L_new(θ) + (λ/2) · Σ_i F_i (θ_i − θ*_i)²                    (Kirkpatrick et al. 2017, eq. 3)

θ* are the weights after the earlier task (the anchor) and F the diagonal of its Fisher
information (``objectives.fisher``), both in one safetensors file, ``fisher.safetensors``
beside the checkpoint (``lmforge fisher``). ``L_new`` is the stage's own loss, a mean per
target over the step; F is a mean per token, so λ = 1 weighs the earlier data like the new
data token for token (the Laplace approximation of the old posterior, up to the ratio of
dataset sizes that λ stands for).

Online EWC keeps one Fisher and one anchor across a sequence of tasks: after each task the
new Fisher is folded into the stored one and the anchor moves to the new weights,

    F ← γ F + (1 − γ) F_new,   θ* ← θ_new                              (EWC++: Chaudhry et al. 2018, eq. 7;
                                                                         online EWC: Schwarz et al. 2018, §2.2)

(``online_fisher``; ``lmforge fisher fold_into=...``).

**Which θ.** Every trainable parameter, by its name in the checkpoint. With LoRA, θ of an
adapted linear is its merged weight W + s·BA (DoRA: (m/‖W + s·BA‖)(W + s·BA), the norm held
constant as in DoRA's own backward), so the penalty reaches the adapters; frozen tensors are
left out (they do not move, so their term is a constant).

**Exact under accumulation and data parallelism.** The loop divides each micro-batch's summed
loss by the target count N of the whole step (over every rank) and multiplies by the
data-parallel size D, as FSDP averages gradients over ranks. ``EWCObjective`` adds the penalty
P to a micro-batch's sum with weight n_m / D, where n_m is that micro-batch's target count
summed over the data-parallel ranks (one all-reduce of a count). The step's weights add up
to Σ_m n_m / N = 1, on every rank alike, so the step's loss is exactly mean + P and each
parameter's gradient gets exactly ∂P/∂θ once. Under FSDP P is computed on the sharded
parameters (DTensors) against a Fisher and anchor sharded as they are: each rank's partial
sum over its shards is all-reduced into P, and the gradient of each shard is that rank's own
(accumulated beside FSDP's reduce-scattered gradient, not averaged by it), which is why every
rank must give P the same weight. Evaluation (no gradient) scores the inner loss alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lmforge.checkpoints.files import load_model_config
from lmforge.checkpoints.load import resolve_checkpoint
from lmforge.core.config import at_least, option
from lmforge.core.io import InputError, atomic_write_bytes
from lmforge.distributed.mesh import ParallelContext
from lmforge.model import families
from lmforge.model.config import ModelConfig
from lmforge.objectives.base import LossOutput, Objective
from lmforge.peft.lora import LoraLinear, lora_modules

FISHER_FILE = "fisher.safetensors"
FISHER_FORMAT = "lmforge-fisher"
# module-name parts that wrappers add and a checkpoint's names do not have
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class EWCConfig:
    """The ``ewc:`` section of a training recipe."""

    fisher: str = option(help="the Fisher file written by `lmforge fisher` (F and the anchor θ*), or the checkpoint "
                         "directory that holds it as fisher.safetensors")
    lambda_: float = at_least(0.0, 1.0, help="λ of (λ/2)·Σ F_i (θ_i − θ*_i)², added to the loss per target "
                              "(0 trains exactly as without ewc)")


def ewc_penalty(params: list[torch.Tensor], fisher: list[torch.Tensor], anchor: list[torch.Tensor],
                lam: float) -> torch.Tensor:
    """(λ/2) · Σ_i F_i (θ_i − θ*_i)²  (Kirkpatrick et al. 2017, eq. 3), over the tensors in order."""
    total = sum((f * (p - a).square()).sum() for p, f, a in zip(params, fisher, anchor, strict=True))
    return 0.5 * lam * total


def online_fisher(stored: dict[str, torch.Tensor], new: dict[str, torch.Tensor], gamma: float) -> dict[str, torch.Tensor]:
    """F ← γ F + (1 − γ) F_new for every tensor (EWC++, Chaudhry et al. 2018, eq. 7); the names must agree."""
    if stored.keys() != new.keys():
        raise ValueError(f"the Fishers name different tensors: {sorted(stored.keys() ^ new.keys())[:3]}")
    return {k: gamma * stored[k] + (1 - gamma) * new[k] for k in new}


# --------------------------------------------------------------------------- the Fisher file


def fisher_path(path: str | Path) -> Path:
    """The Fisher file ``path`` names: itself, or ``fisher.safetensors`` in a folder: the folder's own, else
    that of the checkpoint the folder resolves to (a run directory's newest, a fine-tuning run's final/)."""
    path = Path(path)
    if not path.is_dir() or (path / FISHER_FILE).is_file():
        return path / FISHER_FILE if path.is_dir() else path
    try:
        return resolve_checkpoint(path, verify=False) / FISHER_FILE
    except InputError:
        return path / FISHER_FILE


def write_fisher(path: str | Path, fisher: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor],
                 metadata: dict[str, Any]) -> Path:
    """F and θ* (float32, by parameter name) and ``metadata`` into one safetensors file, atomically."""
    if fisher.keys() != anchor.keys():
        raise ValueError("the Fisher and the anchor must name the same tensors")
    def stored(t: torch.Tensor) -> torch.Tensor:  # a copy: safetensors refuses two names for one storage
        return t.detach().to("cpu", torch.float32, copy=True).contiguous()

    tensors = {f"fisher/{k}": stored(v) for k, v in fisher.items()} | {f"anchor/{k}": stored(v) for k, v in anchor.items()}
    path = Path(path)
    atomic_write_bytes(path, save(tensors, metadata={"format": FISHER_FORMAT, **{k: str(v) for k, v in metadata.items()}}))
    return path


def read_fisher(path: str | Path, key: str = "ewc.fisher") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                   dict[str, str]]:
    """F, θ* and the metadata of a Fisher file; an ``InputError`` names ``key`` and the file."""
    path = fisher_path(path)
    if not path.is_file():
        raise InputError(f"{key}: {path} does not exist; write it with `lmforge fisher checkpoint=...`")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise InputError(f"{key}: {path} is not a readable safetensors file ({exc})") from exc
    if metadata.get("format") != FISHER_FORMAT:
        raise InputError(f"{key}: {path} is not a Fisher file written by `lmforge fisher`")
    fisher = {n.removeprefix("fisher/"): t for n, t in tensors.items() if n.startswith("fisher/")}
    anchor = {n.removeprefix("anchor/"): t for n, t in tensors.items() if n.startswith("anchor/")}
    if fisher.keys() != anchor.keys():
        raise InputError(f"{key}: {path} names different tensors in its Fisher and its anchor; it is damaged")
    bad = [n for n, t in fisher.items() if not torch.isfinite(t).all() or (t < 0).any()]
    if bad:
        raise InputError(f"{key}: {path}: the Fisher of {bad[0]} is negative or not finite; it is damaged")
    return fisher, anchor, metadata


def check_fisher_shapes(shapes: dict[str, tuple[int, ...]], fisher: dict[str, torch.Tensor], where: Path,
                        key: str = "ewc.fisher") -> None:
    """Every tensor of ``shapes`` (a model's parameters by name) has a Fisher of its shape, else one line."""
    for name, shape in shapes.items():
        if name not in fisher:
            raise InputError(f"{key}: {where} has no Fisher for {name}: it was computed for another model")
        if tuple(fisher[name].shape) != tuple(shape):
            raise InputError(f"{key}: {where} holds {name} of shape {tuple(fisher[name].shape)}, the model's is "
                             f"{tuple(shape)}: it was computed for another model")


# --------------------------------------------------------------------------- the model's θ


def checkpoint_name(name: str) -> str:
    """A parameter's or module's name as the checkpoint has it, without wrappers' parts."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (its gradient lands on the shard), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter whole on every rank; in the backward each rank's gradient of it is summed
    into the shards (reduce-scatter), as every rank's rows of a product used all of it."""
    if not isinstance(t, DTensor):
        return t
    partial = [Partial() if isinstance(p, Shard) else Replicate() for p in t.placements]
    return t.full_tensor(grad_placements=partial)


def adapted_weight(layer: LoraLinear) -> torch.Tensor:
    """This rank's rows of the weight a LoRA/DoRA layer computes with, differentiable in its adapters:
    W + s·BA, or (m/n)(W + s·BA) with DoRA's row norm n held constant (DoRA §4.3, as the layer's forward).
    Under FSDP W, B and m are split by rows alike and A is gathered."""
    weight = local(layer.base_weight()) + layer.scaling * (local(layer.lora_B.weight) @ gathered(layer.lora_A.weight))
    if layer.lora_magnitude_vector is not None:
        norm = torch.linalg.norm(weight.detach(), dim=1)
        weight = (local(layer.lora_magnitude_vector) / norm).view(-1, 1) * weight
    return weight


def trained_tensors(model: nn.Module) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """Checkpoint name -> (this rank's part of θ as a function of the trained parameters, the tensor
    whose layout F and θ* take): each trainable parameter, and for each LoRA layer its adapted weight
    (in place of its adapters)."""
    out: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]] = {}
    layers = lora_modules(model)
    inside = tuple(f"{name}." for name in layers)
    for name, layer in layers.items():
        out[checkpoint_name(f"{name}.weight")] = (lambda layer=layer: adapted_weight(layer), layer.base.weight)
    for name, p in model.named_parameters():
        if p.requires_grad and not name.startswith(inside):
            out[checkpoint_name(name)] = (lambda p=p: local(p), p)
    return out


def local_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value`` laid out as ``like``: for a DTensor ``like`` its shard (as FSDP and
    TP split: ``torch.chunk``), else ``value`` on its device and dtype."""
    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements).to_local()
    return value.to(like.device, like.dtype)


def shard_group(like: torch.Tensor) -> tuple | None:
    """What this rank's partial sums are summed over: the mesh dims ``like`` is sharded on (None: not a DTensor)."""
    if not isinstance(like, DTensor):
        return None
    return like.device_mesh, tuple(isinstance(p, Shard) for p in like.placements)


class EWCPenalty:
    """P(θ) = (λ/2) · Σ_i F_i (θ_i − θ*_i)² of a prepared model (LoRA, FSDP), computed when called.

    Each rank computes the penalty of its own shards against its shards of F and θ*; the value is
    their sum over the shards (replicas counted once), and the gradient is each rank's own term's,
    on its own shards: ``local + (total - local).detach()``. Autograd through the collectives
    would hand FSDP a gradient laid out as the reduction left it, not as the shard it accumulates."""

    def __init__(self, model: nn.Module, fisher: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor],
                 lam: float, where: Path | str):
        tensors = trained_tensors(model)
        check_fisher_shapes({n: tuple(like.shape) for n, (_, like) in tensors.items()}, fisher, Path(where))
        self.lam = lam
        self.terms = [(value, local_like(fisher[n], like), local_like(anchor[n], like), shard_group(like))
                      for n, (value, like) in tensors.items()]

    def __call__(self) -> torch.Tensor:
        groups: dict[tuple | None, list[torch.Tensor]] = {}
        device = self.terms[0][1].device.type if self.terms else "cpu"
        with torch.autocast(device, enabled=False):  # in the weights' precision, LoRA's B·A too
            for value, fisher, anchor, group in self.terms:
                groups.setdefault(group, []).append(ewc_penalty([value()], [fisher], [anchor], self.lam))
        local = sum(sum(parts) for parts in groups.values())
        total = sum(summed_over_shards(sum(parts).detach(), group) for group, parts in groups.items())
        return local + (total - local.detach())


def summed_over_shards(partial: torch.Tensor, group: tuple | None) -> torch.Tensor:
    """A rank's partial sum summed over the mesh dims its tensors are sharded on (not over replicas)."""
    if group is None:
        return partial
    mesh, sharded = group
    placements = [Partial() if s else Replicate() for s in sharded]
    return DTensor.from_local(partial, mesh, placements, run_check=False).full_tensor()


class EWCObjective(Objective):
    """``inner``'s loss plus the EWC penalty, weighted so that the step's total is exactly the
    inner mean per target + P (see the module's docstring); logged as ``ewc/penalty``."""

    def __init__(self, inner: Objective, penalty: Callable[[], torch.Tensor],
                 sum_over_dp: Callable[[torch.Tensor], torch.Tensor] | None = None, dp: int = 1):
        self.inner, self.penalty, self.sum_over_dp, self.dp = inner, penalty, sum_over_dp, dp

    @property
    def static_shapes(self) -> bool:  # type: ignore[override]
        return self.inner.static_shapes

    @static_shapes.setter
    def static_shapes(self, value: bool) -> None:
        self.inner.static_shapes = value

    def num_targets(self, batch: Any) -> int:
        return self.inner.num_targets(batch)

    def num_tokens(self, batch: Any) -> int:
        return self.inner.num_tokens(batch)

    def state_dict(self) -> dict | None:  # the penalty keeps none; the inner objective may (distill.replay)
        return self.inner.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.inner.load_state_dict(state)

    def weight(self, n_targets: int, device: torch.device) -> torch.Tensor:
        """n_m / D: this micro-batch's target count over the data-parallel ranks, over D."""
        count = torch.tensor(float(n_targets), dtype=torch.float64, device=device)
        if self.sum_over_dp is not None:
            count = self.sum_over_dp(count)
        return count / self.dp

    def __call__(self, model: nn.Module, batch: Any) -> LossOutput:
        out = self.inner(model, batch)
        if not torch.is_grad_enabled():
            return out
        penalty = self.penalty()
        term = penalty * self.weight(self.inner.num_targets(batch), penalty.device).to(penalty.dtype)
        metrics = {**out.metrics, "ewc/penalty": term.detach()}
        return dataclasses.replace(out, loss_sum=out.loss_sum + term.to(out.loss_sum.dtype), metrics=metrics)


def ewc_objective(inner: Objective, cfg: EWCConfig | None, model: nn.Module,
                  parallel: ParallelContext | None = None) -> Objective:
    """``inner`` with ``cfg``'s penalty on the prepared ``model`` (``inner`` itself without ``ewc:``)."""
    if cfg is None:
        return inner
    fisher, anchor, _ = read_fisher(cfg.fisher)
    penalty = EWCPenalty(model, fisher, anchor, cfg.lambda_, fisher_path(cfg.fisher))
    if parallel is None:
        return EWCObjective(inner, penalty)
    return EWCObjective(inner, penalty, parallel.all_reduce_dp, parallel.layout.dp)


def check_ewc(cfg: EWCConfig | None, shapes: Callable[[], dict[str, tuple[int, ...]]]) -> None:
    """Before a run writes anything: ``cfg.fisher`` reads and fits ``shapes()`` (the parameters by name)."""
    if cfg is None:
        return
    fisher, _, _ = read_fisher(cfg.fisher)
    check_fisher_shapes(shapes(), fisher, fisher_path(cfg.fisher))


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameters' shapes by name of the model ``cfg`` builds (on the meta device: no memory)."""
    with torch.device("meta"):
        model = families.build(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """``model_shapes`` of the checkpoint at ``path`` (a checkpoint or run directory), from its config."""
    return model_shapes(load_model_config(resolve_checkpoint(path, verify=False)))
