"""Multi-token prediction (Gloeckle et al. 2024; DeepSeek-V3's sequential form, DeepSeek-AI 2024 §2.2).

``model.mtp.depth`` = D modules after the model's last block. Module k (1..D) predicts the token k + 1
places ahead of each position from the previous depth's hidden state and the embedding of the token k
places ahead, keeping the causal chain at every depth:

    h'_i^k   = M_k [ RMSNorm(Emb(t_{i+k})) ; RMSNorm(h_i^{k-1}) ]       (M_k: a d x 2d projection)
    h_{1:T-k}^k = TRM_k(h'_{1:T-k}^k)                                     (a block of the model's family)
    P_{i+k+1}^k = OutHead(RMSNorm(h_i^k))                                 (the model's shared head)

h^0 is the main model's final hidden state and ``Emb``/``OutHead`` are the model's own embedding and
head, shared. The concatenation puts the embedding first, as DeepSeek-V3's released weights (``eh_proj``)
and vLLM's ``DeepSeekMTP`` do; the report writes the two halves the other way, which only permutes the
projection's columns. Each depth's block has its own layer index (``n_layers + k - 1``: its KV cache
slot and its MoE metrics' name) and the family's kind of block (a routed FFN where the model's last
layer has one).

Training (``multi_token_loss``): a forward in training mode with ``mtp=MTPTargets(...)`` records each
depth's summed cross-entropy and target count on ``model.mtp``; the step runner adds
λ/D · Σ_k (summed loss of depth k) / (the step's main target count) to the loss (DeepSeek-V3 divides
each depth's loss by T, the main loss's count) and logs ``mtp/depth<k>``, each depth's mean loss per
target. A depth's target is masked where it is not trained (a label of ``IGNORE_INDEX``) and where
position i and the target i + k + 1 lie in different documents (``MTPTargets.documents``), so no
depth predicts across a document boundary. Evaluation and generation never run the modules; the
inference engine can draft with them (``lmforge.inference.speculative``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import at_least
from lmforge.data.packing import IGNORE_INDEX


@dataclass
class MTPConfig:
    """``model.mtp``: DeepSeek-V3's sequential multi-token prediction modules (``lmforge.model.mtp``)."""

    depth: int = at_least(0, 0, help="MTP modules D: module k predicts the token k + 1 ahead (DeepSeek-V3: 1); "
                          "0 = none. Each adds one block of the family and a d x 2d projection")
    loss_weight: float = at_least(0, 0.3, help="λ: the MTP loss λ/D·Σ_k L_k is added to the main loss (DeepSeek-V3: "
                                  "0.3 for the first 10T tokens, then 0.1)")

    @property
    def enabled(self) -> bool:
        return self.depth > 0


def mtp_config(value: MTPConfig | dict | None) -> MTPConfig:
    """``model.mtp`` from a recipe's or a checkpoint's mapping."""
    return value if isinstance(value, MTPConfig) else MTPConfig(**(value or {}))


@dataclass
class MTPTargets:
    """What the MTP losses read beyond the main forward's inputs, each (B, L): ``tokens`` t_0 .. t_{L-1}
    (the main forward's inputs are the first L - 1 of them, a pre-training window's inputs, or all L,
    an SFT row whose last position has no target), ``labels`` the ids trained at each position
    (``IGNORE_INDEX`` where none: a prompt, padding) and ``documents`` each token's document index."""

    tokens: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor


def documents_from_starts(tokens: torch.Tensor, start_id: int | None) -> torch.Tensor:
    """(B, L) document index of each token of pre-training windows, a new document at each ``start_id``
    (the BOS token ``prepare`` puts before every document); zeros without one."""
    if start_id is None:
        return torch.zeros_like(tokens)
    return (tokens == start_id).long().cumsum(dim=-1)


def depth_targets(targets: MTPTargets, k: int) -> torch.Tensor:
    """(B, L - k - 1) depth k's target at each position i: ``labels[i + k + 1]``, or ``IGNORE_INDEX`` where
    that is not trained or lies in another document than position i."""
    n = targets.tokens.shape[1] - k - 1
    labels = targets.labels[:, k + 1 : k + 1 + n]
    same = targets.documents[:, k + 1 : k + 1 + n] == targets.documents[:, :n]
    return labels.masked_fill(~same, IGNORE_INDEX)


def multi_token_loss(depth_logits: list[torch.Tensor], depth_labels: list[torch.Tensor],
                     ignore_index: int = IGNORE_INDEX) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each depth's summed cross-entropy and its target count, in float32 (DeepSeek-AI 2024, eq. 24-25):

        L_MTP^k = -(1/T) Σ_i log P_i^k[t_i],        L_MTP = (λ/D) Σ_{k=1..D} L_MTP^k

    ``depth_logits[k-1]`` (B, n_k, V) are depth k's logits and ``depth_labels[k-1]`` (B, n_k) its targets
    (``depth_targets``); the sums are returned, so the caller divides by the step's count T and weighs
    by λ/D, as the main loss's sum is divided (``StepRunner.backward``)."""
    out = []
    for logits, labels in zip(depth_logits, depth_labels):
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum")
        out.append((loss, (labels != ignore_index).sum()))
    return out


class MTPModule(nn.Module):
    """Depth k's own parts: the embedding's and the hidden state's RMSNorms, the d x 2d projection M_k, a
    block of the model's family, and the RMSNorm before the shared head (DeepSeek-V3's ``enorm``,
    ``hnorm``, ``eh_proj``, the block, ``shared_head.norm``)."""

    def __init__(self, d_model: int, eps: float, block: nn.Module):
        super().__init__()
        self.embed_norm = nn.RMSNorm(d_model, eps=eps)
        self.hidden_norm = nn.RMSNorm(d_model, eps=eps)
        self.proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(d_model, eps=eps)

    def join(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """h' = M_k [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h_i^{k-1})], (B, T, d_model)."""
        return self.proj(torch.cat((self.embed_norm(embedded), self.hidden_norm(hidden)), dim=-1))


class MTPModules(nn.ModuleList):
    """The model's D modules, and what the last training forward recorded: per depth, (summed loss, targets)."""

    def __init__(self, modules: list[MTPModule], loss_weight: float):
        super().__init__(modules)
        self.loss_weight = loss_weight
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []


def mtp_modules(model: nn.Module) -> MTPModules | None:
    """The model's MTP modules, or None (a model without them, a pipeline stage without the head)."""
    modules = getattr(model, "mtp", None)
    return modules if isinstance(modules, MTPModules) and len(modules) else None


def clear(model: nn.Module) -> None:
    """Forget the last forward's records (before a micro-batch, as ``moe.clear``)."""
    modules = mtp_modules(model)
    if modules is not None:
        modules.losses = []


def recorded_losses(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth, the last training forward's summed loss (with gradients) and target count; empty when none ran."""
    modules = mtp_modules(model)
    return modules.losses if modules is not None else []


def check_depth(depth: int, seq_len: int, key: str = "data.seq_len") -> str | None:
    """Why ``model.mtp.depth`` leaves no target in a window of ``seq_len`` inputs (None: it fits): depth k
    predicts the token k + 1 ahead, so the last depth needs at least depth + 2 tokens in a window."""
    if depth and depth >= seq_len:
        return (f"model.mtp.depth = {depth} leaves no tokens to predict in a window of {key} = {seq_len}: depth k "
                f"predicts the token k + 1 ahead; set model.mtp.depth below {seq_len}")
    return None

