"""Model merging: the rules of linear averaging, task arithmetic, TIES and DARE as pure tensor
functions, and LoRA adapters merged the way peft's ``add_weighted_adapter`` merges them.

A *task vector* is what fine-tuning changed, τ_i = θ_i − θ_base (Ilharco et al. 2023). Each rule
turns the inputs' τ_i and weights w_i into one merged τ (``combine``):

- ``linear`` / task arithmetic:  τ = Σ_i w_i τ_i
- ``ties`` (Yadav et al. 2023): trim each τ_i to its ``density`` fraction of largest magnitudes
  (τ̂_i), elect each entry's sign by the sign of Σ_i τ̂_i (the mass; + where it is 0), and take
  the disjoint mean τ = Σ_i w_i τ̂_i [sign τ̂_i = elected] / #{i : sign τ̂_i = elected}
- ``dare_linear`` / ``dare_ties`` (Yu et al. 2024): drop each entry of τ_i with probability p and
  rescale the kept ones, τ̃_i = m_i ⊙ τ_i / (1 − p) with m_i ~ Bernoulli(1 − p), then the linear
  sum or TIES' sign election and disjoint mean (without the trim) of the τ̃_i
- ``magnitude_prune``: TIES' trim without the election, τ = Σ_i w_i τ̂_i

These are peft's ``utils/merge_utils.py`` functions (``task_arithmetic``, ``ties``,
``dare_linear``, ``dare_ties``, ``magnitude_prune``) term for term: the sign is elected from the unweighted values and
the weights enter the disjoint mean; the divisor is the count of agreeing inputs (mergekit's
``normalize`` divides by the sum of their weights instead: the same for weights of 1).

**How adapters merge** (``merge_adapters``), exactly as ``LoraModel.add_weighted_adapter`` for its
combination types of the same names. An adapter's update is ΔW_i = s_i·B_i A_i (s_i = α/r, or α/√r
with rsLoRA). peft's ``linear``, ``ties``, ``dare_linear``, ``dare_ties`` and ``magnitude_prune`` do
*not* combine the ΔW_i: they combine the factors, the A_i with weights ±√|w_i s_i| (the sign of w_i s_i) and the
B_i with √|w_i s_i|, each by the rule above, into one rank-r adapter with scaling 1. For
``linear`` that is ΔW = (Σ_i √|w_i s_i| B_i)(Σ_i ±√|w_i s_i| A_i), which holds the cross terms
B_i A_j: it is the weighted sum of the updates only for one adapter (peft calls it "a very rough
approximation"). ``cat`` is exact: A = [w_1 s_1 A_1; w_2 s_2 A_2; ...] and B = [B_1 B_2 ...], of
rank Σ r_i, so ΔW = Σ_i w_i s_i B_i A_i = Σ_i w_i ΔW_i: task arithmetic of the adapters. The
``svd`` types (``svd``, ``ties_svd``, ``dare_linear_svd``, ``dare_ties_svd``,
``magnitude_prune_svd``) apply the rule to the whole updates ΔW_i, the papers' task vectors, and keep the rank-k
truncated SVD of the result, U_k S_k V_kᵀ as B = U_k S_k and A = V_kᵀ (k = ``svd_rank``, else
the largest r_i): exact when the merged update's rank is at most k. The
merged adapter is written with ``lora_alpha = scale·r`` (so its scaling is ``scale``, 1 by
default: peft's) and without rsLoRA (peft keeps the first adapter's ``use_rslora`` with
``lora_alpha = r``, which scales an rsLoRA merge by √r).

DARE's masks are seeded per tensor (``keep_mask``: a generator seeded by the merge's seed and the
tensor's name and input), so a merge is reproducible whatever the order in which tensors are
visited; peft draws them from torch's global generator in its module order.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from lmforge.core.io import InputError, atomic_write_json
from lmforge.peft.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, peft_config_dict, read_adapter_config
from lmforge.peft.lora import LoraConfig

# the rules of ``combine``; ``cat`` is for adapters only (their factors joined, an exact sum)
RULES = ("linear", "ties", "dare_linear", "dare_ties", "magnitude_prune")
# peft's *_svd types: the rule on the whole updates s_i·B_i A_i, then a truncated SVD back to a rank
SVD_METHODS = ("svd", "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd")
ADAPTER_METHODS = ("linear", "cat", "ties", "dare_linear", "dare_ties", "magnitude_prune", *SVD_METHODS)
# which rules read ``density`` (TIES' trim) and ``drop_rate`` (DARE's drop)
TRIMS = ("ties", "magnitude_prune")
DROPS = ("dare_linear", "dare_ties")
ELECTS = ("ties", "dare_ties")

KeepMask = Callable[[str, int, torch.Tensor, float], torch.Tensor]


def rule_of(method: str) -> str | None:
    """The rule ``combine`` applies for a merge method: ``ties_svd`` -> ``ties``, ``svd`` ->
    ``linear``, ``task_arithmetic`` -> ``linear``; None for ``cat``, which only joins factors."""
    if method == "cat":
        return None
    if method in ("svd", "task_arithmetic"):
        return "linear"
    return method.removesuffix("_svd")


def trim_to_density(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """TIES' trim: keep the ``k = int(density · numel)`` entries of largest magnitude, zero the rest
    (peft's ``magnitude_based_pruning``; ties broken as ``torch.topk`` breaks them). density >= 1
    keeps everything."""
    if density >= 1:
        return tensor
    flat = tensor.reshape(-1)
    mask = torch.zeros_like(flat)
    mask[torch.topk(flat.abs(), k=int(density * flat.numel()), largest=True).indices] = 1
    return tensor * mask.reshape(tensor.shape)


def elected_sign_mask(stacked: torch.Tensor) -> torch.Tensor:
    """TIES' sign election over inputs stacked on dim 0: γ = sign(Σ_i τ̂_i) (the mass; +1 where the
    sum is 0), and the mask of entries whose sign is γ (a trimmed zero agrees with neither)."""
    elected = torch.where(stacked.sum(dim=0) >= 0, 1, -1)
    return stacked.sign() == elected


def disjoint_mean(weighted: torch.Tensor, agree: torch.Tensor) -> torch.Tensor:
    """TIES' disjoint merge: Σ_i agree_i · (w_i τ̂_i) / max(#agree, 1), entry by entry."""
    return (weighted * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def dare_rescale(tensor: torch.Tensor, keep: torch.Tensor, drop_rate: float) -> torch.Tensor:
    """DARE: the entries kept by the 0/1 mask ``keep`` rescaled by 1/(1 − p), the others zero, so
    E[result] = tensor when keep ~ Bernoulli(1 − p)."""
    return tensor * keep / (1 - drop_rate)


def seed_for(seed: int, name: str) -> int:
    """A 63-bit seed for one tensor's mask from the merge's seed and the tensor's name."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def seeded_keep_mask(seed: int) -> KeepMask:
    """DARE's masks for a merge of seed ``seed``: for the tensor ``name`` of input i, Bernoulli(1 − p)
    draws from a generator seeded by (seed, name, i) alone."""
    def keep_mask(name: str, index: int, tensor: torch.Tensor, drop_rate: float) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed_for(seed, f"{name}/{index}"))
        probs = torch.full(tensor.shape, 1 - drop_rate, dtype=torch.float32)
        return torch.bernoulli(probs, generator=generator).to(tensor.device, tensor.dtype)
    return keep_mask


def combine(tensors: Sequence[torch.Tensor], weights: Sequence[float], rule: str, density: float = 1.0,
            drop_rate: float = 0.0, keep_mask: KeepMask | None = None, name: str = "") -> torch.Tensor:
    """One merged task vector from the inputs' ``tensors`` (τ_i) and ``weights`` (w_i) by ``rule``
    (see the module's docstring for each rule's equation). ``keep_mask(name, i, τ_i, p)`` gives
    DARE's 0/1 masks (``seeded_keep_mask``)."""
    if rule not in RULES:
        raise ValueError(f"merge rule {rule!r} is unknown; choose one of {', '.join(RULES)}")
    tensors = list(tensors)
    if rule in TRIMS:
        tensors = [trim_to_density(t, density) for t in tensors]
    if rule in DROPS:
        if keep_mask is None:
            raise ValueError(f"{rule}: give keep_mask (seeded_keep_mask(seed)) to draw DARE's masks")
        tensors = [dare_rescale(t, keep_mask(name, i, t, drop_rate), drop_rate) for i, t in enumerate(tensors)]
    stacked = torch.stack(tensors)
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device).view(-1, *([1] * (stacked.dim() - 1)))
    if rule in ELECTS:
        return disjoint_mean(stacked * w, elected_sign_mask(stacked))
    return (stacked * w).sum(dim=0)


# --------------------------------------------------------------------------- LoRA adapters


class Adapter(NamedTuple):
    """One LoRA adapter's factors by module (PEFT's module names: ``base_model.model.model.layers.0.self_attn.q_proj``)."""

    r: int
    scaling: float  # s = α/r, or α/√r with rsLoRA
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r))


def merge_adapters(adapters: Sequence[Adapter], weights: Sequence[float], method: str, density: float = 1.0,
                   drop_rate: float = 0.0, seed: int = 0, keep_mask: KeepMask | None = None,
                   svd_rank: int | None = None) -> Adapter:
    """The adapters merged by ``method`` as ``add_weighted_adapter(..., combination_type=method)``
    merges them (peft's density is ``density`` for ties, 1 − ``drop_rate`` for DARE): a rank-r adapter
    (rank Σ r_i for ``cat``, ``svd_rank`` or the largest r_i for the svd types) with scaling 1.
    Factors are combined in float32 and returned in the first adapter's dtype. Every adapter must
    wrap the same modules, with one rank except for ``cat`` and the svd types."""
    if method not in ADAPTER_METHODS:
        raise ValueError(f"adapter merge method {method!r} is unknown; choose one of {', '.join(ADAPTER_METHODS)}")
    if len(adapters) == 1:
        method = "linear"  # as peft: one adapter is only ever scaled
    keep_mask = keep_mask or seeded_keep_mask(seed)
    rank = svd_rank or max(a.r for a in adapters)
    merged = {}
    for module in adapters[0].factors:
        pairs = [a.factors[module] for a in adapters]
        dtype = pairs[0][0].dtype
        if method in SVD_METHODS:
            deltas = [(B.float() @ A.float()) * a.scaling for (A, B), a in zip(pairs, adapters)]  # peft's get_delta_weight
            delta = combine(deltas, weights, rule_of(method), density, drop_rate, keep_mask, f"{module}.delta")
            U, S, Vh = torch.linalg.svd(delta, full_matrices=True)
            A, B = Vh[:rank, :], U[:, :rank] @ torch.diag(S[:rank])
        elif method == "cat":
            A = torch.cat([w * a.scaling * A.float() for (A, _), w, a in zip(pairs, weights, adapters)], dim=0)
            B = torch.cat([B.float() for _, B in pairs], dim=1)
        else:
            ws = [w * a.scaling for w, a in zip(weights, adapters)]
            root = [math.sqrt(abs(x)) for x in ws]
            weights_A = [r if x >= 0 else -r for r, x in zip(root, ws)]
            A = combine([A.float() for A, _ in pairs], weights_A, method, density, drop_rate, keep_mask, f"{module}.lora_A")
            B = combine([B.float() for _, B in pairs], root, method, density, drop_rate, keep_mask, f"{module}.lora_B")
        merged[module] = (A.to(dtype), B.to(dtype))
    r = sum(a.r for a in adapters) if method == "cat" else rank if method in SVD_METHODS else adapters[0].r
    return Adapter(r=r, scaling=1.0, factors=merged)


def delta_weights(adapter: Adapter) -> dict[str, torch.Tensor]:
    """Each module's update s·B A (float32), what merging the adapter into its base adds."""
    return {m: adapter.scaling * (B.float() @ A.float()) for m, (A, B) in adapter.factors.items()}


# --------------------------------------------------------------------------- adapter folders


def read_adapter(directory: str | Path, where: str = "") -> tuple[dict, Adapter]:
    """A PEFT adapter folder's ``adapter_config.json`` and its factors; an ``InputError`` (prefixed by
    ``where``, e.g. the recipe key) for a folder lmforge cannot merge: not a LoRA adapter, DoRA (its
    magnitudes have no merge rule, in peft neither), or tensors that are not PEFT's LoRA pairs."""
    directory = Path(directory)
    prefix = f"{where}: " if where else ""
    try:
        cfg = read_adapter_config(directory)
        config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except InputError as exc:
        raise InputError(f"{prefix}{exc}") from exc
    if cfg.use_dora:
        raise InputError(f"{prefix}{directory / ADAPTER_CONFIG}: a DoRA adapter; its magnitude vectors have no merge rule "
                         "(nor in peft's add_weighted_adapter): merge the fine-tuned checkpoints (the runs' final/) instead")
    weights_path = directory / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(weights_path))
    except FileNotFoundError as exc:
        raise InputError(f"{prefix}{weights_path}: not found (lmforge reads safetensors adapters)") from exc
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise InputError(f"{prefix}{weights_path}: cannot read the adapter: {exc}") from exc
    factors = {}
    for key in sorted(tensors):
        module, _, suffix = key.rpartition(".lora_")
        if suffix not in ("A.weight", "B.weight") or not module.startswith(PEFT_PREFIX):
            raise InputError(f"{prefix}{weights_path}: unexpected tensor {key!r}; expected {PEFT_PREFIX}<module>.lora_A.weight "
                             "and .lora_B.weight")
        factors.setdefault(module, {})[suffix[0]] = tensors[key]
    pairs = {}
    for module, ab in factors.items():
        if set(ab) != {"A", "B"}:
            raise InputError(f"{prefix}{weights_path}: {module} has lora_{next(iter(ab))} without its pair")
        A, B = ab["A"], ab["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != cfg.r or B.shape[1] != cfg.r:
            raise InputError(f"{prefix}{weights_path}: {module}'s factors have shapes {tuple(A.shape)} and "
                             f"{tuple(B.shape)}, not (r, in) and (out, r) with r={cfg.r} of {ADAPTER_CONFIG}")
        pairs[module] = (A, B)
    if not pairs:
        raise InputError(f"{prefix}{weights_path}: holds no LoRA factors")
    return config, Adapter(r=cfg.r, scaling=cfg.scaling, factors=pairs)


def write_adapter_files(directory: Path, adapter: Adapter, first_config: dict, scale: float) -> None:
    """``adapter`` as PEFT's files in ``directory`` (``lora_alpha = scale·r``, so peft scales it by
    ``scale``; no rsLoRA), with the first input's targets, dropout and base model."""
    if adapter.scaling != 1.0:
        raise ValueError("write_adapter_files: write a merged adapter (scaling 1, from merge_adapters)")
    cfg = LoraConfig(r=adapter.r, alpha=scale * adapter.r, dropout=first_config.get("lora_dropout", 0.0))
    config = peft_config_dict(cfg, first_config["target_modules"], first_config.get("base_model_name_or_path"))
    tensors = {}
    for module, (A, B) in adapter.factors.items():
        tensors[f"{module}.lora_A.weight"] = A.contiguous()
        tensors[f"{module}.lora_B.weight"] = B.contiguous()
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    atomic_write_json(directory / ADAPTER_CONFIG, config)
