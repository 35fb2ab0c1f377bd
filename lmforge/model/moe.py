"""A routed feed-forward layer, the mixture of experts (Shazeer et al. 2017; Switch, GShard, Mixtral,
DeepSeek-V3), read top to bottom: a ``Router`` picks each token's top-k experts and their weights,
``Experts`` runs every expert's SwiGLU on the tokens sent to it, ``MoE`` joins them (plus DeepSeek's
shared experts) and records what the loop reads after the forward: the auxiliary losses and each
expert's load.

``MoE(d_model, cfg: MoEConfig, layer)`` takes (B, T, d_model) and returns (B, T, d_model), like
``transformer.MLP``, so a family's block uses it in the MLP's place (``MoEConfig.sparse_layers``
says which layers; the others keep the dense MLP). After a forward in training with gradients:

- ``moe.aux_losses``: name -> the weighted auxiliary loss of that forward (``load_balance``,
  ``seq_balance``, ``z_loss``; only those whose coefficient is set), scalars with gradients;
  ``aux_losses(model)`` averages each over the model's MoE layers, what the step runner adds.
- ``moe.last_load`` (E,) tokens routed to each expert (before capacity), ``moe.last_dropped``
  the token-expert assignments past an expert's capacity; ``LoadTracker`` sums them over a
  step's micro-batches (and data-parallel ranks), nudges the aux-loss-free bias after each
  optimizer step and gives the per-layer metrics (``load_metrics``).

A forward in evaluation or without gradients (a reference model, decoding) records nothing and
changes nothing: the bias is frozen there.

Routing follows transformers' Mixtral / Qwen3-MoE / DeepSeek-V3 routers, the numeric reference:
router logits in float32, scores softmax (over all experts) or sigmoid; selection by the scores
plus the selection bias (``expert_bias``, transformers' ``e_score_correction_bias``), optionally
restricted to the ``topk_group`` groups of experts whose two best biased scores sum highest
(masked with -inf, as DeepSeek-V3); weights are the unbiased scores of the chosen experts,
normalised to sum to 1 if ``norm_topk_prob``, times ``routed_scaling_factor``.

Experts' weights are stacked 3-D parameters, each expert's matrix in ``nn.Linear``'s (out, in)
layout: ``w1``, ``w3`` (E, f, d) and ``w2`` (E, d, f), as torchtitan's ``GroupedExperts`` and
transformers 5's ``*Experts`` hold them. Why stacked: one tensor per matrix kind is what a grouped
matmul multiplies (``torch._grouped_mm`` takes the (E, in, out) view and the tokens sorted by
expert with their offsets), FSDP2 shards three tensors per layer on the expert dimension instead
of 3E small ones (and expert parallelism would split the same dimension), and an HF checkpoint's
per-expert matrices (``experts.<e>.w1.weight``) are the slices ``w1[e]``, so import and export are
a stack and an unbind. LoRA wraps ``nn.Linear``s only, so adapters reach attention and the router
but not the experts (``lmforge.peft`` refuses them by name).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import at_least, check_ranges, option, positive


@dataclass
class MoEConfig:
    """``model.moe``: the routed FFN of a mixture-of-experts family (Mixtral, Qwen3-MoE, DeepSeek-V3).

    Balancing is chosen by the coefficients, each 0 (off) by default: ``aux_loss_coef`` (Switch /
    GShard's α·E·Σ f_i·P_i), ``seq_aux_loss_coef`` (DeepSeek-V3's per-sequence form), ``z_loss_coef``
    (ST-MoE's router z-loss), and ``bias_update_rate`` γ (DeepSeek-V3's auxiliary-loss-free bias).
    """

    n_experts: int = positive(8, help="routed experts per MoE layer (num_local_experts / n_routed_experts)")
    n_experts_per_token: int = positive(2, help="experts each token is routed to, the top-k (num_experts_per_tok)")
    expert_ffn_hidden: int | None = positive(
        None, help="each expert's SwiGLU width (moe_intermediate_size; fine-grained experts are narrow); "
                   "null = the model's ffn_hidden")
    scores: Literal["softmax", "sigmoid"] = option(
        "softmax", help="router scores: softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid each (DeepSeek-V3)")
    norm_topk_prob: bool = option(True, help="divide the chosen experts' weights by their sum (Mixtral always does)")
    routed_scaling_factor: float = positive(1.0, help="the routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)")
    n_shared_experts: int = at_least(0, 0, help="experts every token goes through: one SwiGLU of n_shared_experts "
                                                "times expert_ffn_hidden (DeepSeek-V3: 1)")
    n_group: int = positive(1, help="group-limited routing: the experts in this many groups (DeepSeek-V3: 8)")
    topk_group: int = positive(1, help="group-limited routing: a token's experts come from its best this many groups, "
                                       "a group scored by the sum of its two best scores (DeepSeek-V3: 4)")
    capacity_factor: float | None = positive(
        None, help="in training, an expert takes at most capacity_factor * tokens * top-k / n_experts tokens per forward, the "
                   "later ones dropped (their slot adds nothing) and counted; null = dropless")
    aux_loss_coef: float = at_least(0, 0.0, help="α of the Switch/GShard load-balancing loss α·E·Σ f_i·P_i, the mean "
                                                 "over MoE layers added to the training loss (0 = off)")
    seq_aux_loss_coef: float = at_least(0, 0.0, help="α of DeepSeek-V3's sequence-wise balance loss (0 = off)")
    z_loss_coef: float = at_least(0, 0.0, help="coefficient of the router z-loss, mean (logsumexp logits)² (ST-MoE: 1e-3; 0 = off)")
    bias_update_rate: float = at_least(0, 0.0, help="γ of auxiliary-loss-free balancing: after each optimizer step "
                                                    "each expert's selection bias moves by γ·sign(mean load - load) "
                                                    "(DeepSeek-V3: 1e-3; 0 = off)")
    selection_bias: bool = option(False, help="keep a per-expert selection bias (e_score_correction_bias) even with "
                                              "bias_update_rate 0 (an imported DeepSeek-V3's, held fixed)")
    first_dense_layers: int = at_least(0, 0, help="the first this many layers keep the dense MLP (first_k_dense_replace)")
    sparse_step: int = positive(1, help="every this-many-th layer is an MoE layer (decoder_sparse_step): layer i "
                                        "when (i + 1) % sparse_step == 0")
    dense_layers: list[int] | None = at_least(0, None, help="layers that keep the dense MLP whatever the rules "
                                                            "above say (mlp_only_layers)")

    def __post_init__(self) -> None:
        check_ranges(self, prefix="model.moe.", source="model")
        E, k = self.n_experts, self.n_experts_per_token
        if k > E:
            raise ValueError(f"model.moe.n_experts_per_token = {k} must be at most model.moe.n_experts = {E}")
        if E % self.n_group:
            raise ValueError(f"model.moe.n_experts = {E} must be a multiple of model.moe.n_group = {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"model.moe.topk_group = {self.topk_group} must be at most model.moe.n_group = {self.n_group}")
        if self.n_group > 1 and E // self.n_group < 2:
            raise ValueError(f"model.moe.n_group = {self.n_group} leaves {E // self.n_group} expert per group; a group is "
                             "scored by its two best experts (DeepSeek-V3), so each needs at least 2")
        if k > self.topk_group * (E // self.n_group):
            raise ValueError(f"model.moe.n_experts_per_token = {k} is more than the {self.topk_group * (E // self.n_group)} "
                             "experts of model.moe.topk_group groups")

    @property
    def has_bias(self) -> bool:
        return self.selection_bias or self.bias_update_rate > 0

    def sparse_layers(self, n_layers: int) -> tuple[bool, ...]:
        """Per layer, whether it is an MoE layer (the others keep the dense MLP)."""
        dense = set(self.dense_layers or ())
        return tuple(i >= self.first_dense_layers and (i + 1) % self.sparse_step == 0 and i not in dense
                     for i in range(n_layers))

    def width(self, ffn_hidden: int) -> int:
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else ffn_hidden

    def ffn_weights(self, d_model: int, ffn_hidden: int) -> tuple[int, int]:
        """The routed FFN's weights, (all, a token's): the router (E·d) and the shared experts
        (3·d·n_shared·f) every token uses, and every expert's three matrices (3·E·d·f), of which a
        token's matmuls use its k (the active weights FLOPs and MFU count)."""
        expert = 3 * d_model * self.width(ffn_hidden)
        always = d_model * self.n_experts + self.n_shared_experts * expert
        return always + self.n_experts * expert, always + self.n_experts_per_token * expert

    def ffn_activation_bytes(self, d_model: int, ffn_hidden: int, compute_bytes: int) -> float:
        """Bytes per token autograd keeps for the routed FFN (the memory planner's): the k expert SwiGLUs
        (w1 x, silu, w3 x, product) with each assignment's gathered input and output (2d), the shared
        experts' SwiGLU, and the router's float32 logits, scores and softmax (3E)."""
        c, f = compute_bytes, self.width(ffn_hidden)
        return (c * self.n_experts_per_token * (4 * f + 2 * d_model) + c * 4 * self.n_shared_experts * f
                + 4 * 3 * self.n_experts)

    def mean_ffn_activation_bytes(self, n_layers: int, d_model: int, ffn_hidden: int, dense_bytes: float,
                                  compute_bytes: int) -> float:
        """``ffn_activation_bytes`` on the sparse layers, ``dense_bytes`` on the others, averaged over the layers."""
        sparse = self.ffn_activation_bytes(d_model, ffn_hidden, compute_bytes)
        return sum(sparse if s else dense_bytes for s in self.sparse_layers(n_layers)) / n_layers


def moe_config(value: MoEConfig | dict) -> MoEConfig:
    """A family config's ``moe`` field as a ``MoEConfig`` (read back from a checkpoint's model_config.json: a dict)."""
    return MoEConfig(**value) if isinstance(value, dict) else value


@dataclass
class Routing:
    """A router's decision for N tokens: each token's k experts (N, k) and their weights (N, k), with
    the float32 router logits (N, E) and scores (N, E) the auxiliary losses read."""

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor


class Router(nn.Module):
    """Top-k token choice: logits = x Wᵀ in float32, scores softmax or sigmoid, selection on the scores
    plus ``expert_bias`` (group-limited when ``n_group`` > 1), weights the chosen unbiased scores."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, d_model))
        # the aux-loss-free bias (selection only): a persistent buffer, so checkpoints save and resume it
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if cfg.has_bias else None)

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if cfg.scores == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if cfg.n_group > 1:
            choice = limit_to_groups(choice, cfg.n_group, cfg.topk_group)
        experts = choice.topk(cfg.n_experts_per_token, dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * cfg.routed_scaling_factor, logits, scores)


def limit_to_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: the experts' scores (N, E) with every expert outside the token's
    ``topk_group`` best groups at -inf, a group scored by the sum of its two best scores."""
    grouped = choice.unflatten(-1, (n_group, -1))
    best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)


GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device and dtype (a probe on tiny
    aligned shapes, once). Only GPUs are probed: torch 2.13's CPU kernel has no float32 backward, and
    the loop of matmuls is the CPU path."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


class Experts(nn.Module):
    """E SwiGLU experts, ``w2(silu(w1 x) * w3 x)`` each, over tokens sorted by expert (``counts`` per expert)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        # the dtypes whose grouped matmul runs where the weights are, probed when they move (``_apply``), so
        # a compiled forward reads a constant instead of tracing the probe
        self.grouped_dtypes: frozenset[torch.dtype] = frozenset()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        device = self.w1.device
        self.grouped_dtypes = frozenset(t for t in GROUPED_DTYPES if grouped_mm_works(device, t))
        return out

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        d, f = self.w1.shape[2], self.w1.shape[1]
        aligned = (d * dtype.itemsize) % 16 == 0 and (f * dtype.itemsize) % 16 == 0  # the kernel's stride rule
        if dtype in self.grouped_dtypes and aligned and x.device == self.w1.device:
            return self.grouped(x.to(dtype), counts, dtype)
        return self.looped(x, counts)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One grouped matmul per matrix kind: the offsets are device tensors, so no host sync."""
        offsets = counts.cumsum(0).to(torch.int32)
        w1, w3, w2 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        with torch.autocast(x.device.type, enabled=False):
            h = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
            return torch._grouped_mm(h, w2, offs=offsets)

    @torch.compiler.disable  # its slices' sizes are data: compiled, each step's counts would recompile the graph
    def looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """A matmul per expert on its slice of the sorted tokens (one host sync for the counts); run eagerly
        under ``torch.compile`` (the rest of the model compiles around it)."""
        outputs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            if chunk.shape[0]:
                outputs.append(F.linear(F.silu(F.linear(chunk, self.w1[e])) * F.linear(chunk, self.w3[e]), self.w2[e]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.w2.shape[1])


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one SwiGLU of n_shared·expert width that every token goes through."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The routed FFN (see the module docstring): (B, T, d) -> (B, T, d).

    Dropless token choice: the N·k token-expert assignments are sorted by expert (a stable sort,
    so each expert sees its tokens in order), each expert multiplies its contiguous slice
    (``Experts``), and the outputs, times the routing weights, are added back to their tokens.
    With ``capacity_factor`` an expert keeps its first ⌈cf·N·k/E⌉ assignments and the rest are
    dropped (counted in ``last_dropped``), in training only: evaluation and decoding are dropless, so a
    row's logits never depend on which rows share its batch."""

    def __init__(self, d_model: int, cfg: MoEConfig, layer: int = 0, ffn_hidden: int | None = None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        hidden = cfg.width(ffn_hidden) if ffn_hidden is not None else cfg.expert_ffn_hidden
        if hidden is None:
            raise ValueError("model.moe.expert_ffn_hidden is not set and no ffn_hidden was given to fall back on")
        self.router = Router(d_model, cfg)
        self.experts = Experts(d_model, hidden, cfg.n_experts)
        self.shared = SharedExperts(d_model, cfg.n_shared_experts * hidden) if cfg.n_shared_experts else None
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.last_load: torch.Tensor | None = None
        self.last_dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x)
        N, k, E = x.shape[0], self.cfg.n_experts_per_token, self.cfg.n_experts
        flat = routing.experts.flatten()  # assignment a = token a // k, its (a % k)-th choice
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        kept_counts, dropped = counts, None
        if self.cfg.capacity_factor is not None and self.training:  # evaluation and decoding stay dropless
            capacity = math.ceil(self.cfg.capacity_factor * N * k / E)
            starts = counts.cumsum(0) - counts
            rank = torch.arange(N * k, device=x.device) - starts[flat[order]]  # place in its expert's queue
            order = order[rank < capacity]
            kept_counts = counts.clamp(max=capacity)
            dropped = (counts - kept_counts).sum()
        tokens = order // k
        y = self.experts(x[tokens], kept_counts)
        y = y * routing.weights.flatten()[order, None].to(y.dtype)
        out = torch.zeros(N, shape[-1], device=x.device, dtype=y.dtype).index_add_(0, tokens, y)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and torch.is_grad_enabled():
            self.record(routing, counts, dropped, shape)
        return out.reshape(shape)

    def record(self, routing: Routing, counts: torch.Tensor, dropped: torch.Tensor | None, shape: torch.Size) -> None:
        """What the loop reads after a training forward: the weighted auxiliary losses and the load.
        Recomputed alike under activation checkpointing (assignments, not increments)."""
        cfg = self.cfg
        self.last_load = counts.detach()
        self.last_dropped = dropped if dropped is not None else counts.new_zeros(())
        losses = {}
        if cfg.aux_loss_coef:
            losses["load_balance"] = cfg.aux_loss_coef * load_balance_loss(routing, cfg.n_experts, cfg.scores)
        if cfg.seq_aux_loss_coef:
            losses["seq_balance"] = cfg.seq_aux_loss_coef * sequence_balance_loss(routing, cfg.n_experts, shape[0])
        if cfg.z_loss_coef:
            losses["z_loss"] = cfg.z_loss_coef * router_z_loss(routing.logits)
        self.aux_losses = losses


# --------------------------------------------------------------------------- balancing losses


def normalised_scores(routing: Routing, scores: str) -> torch.Tensor:
    """Per token, the scores as a distribution over experts: softmax's as they are, sigmoids divided by their sum."""
    return routing.scores if scores == "softmax" else routing.scores / routing.scores.sum(dim=-1, keepdim=True)


def routed_fraction(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """f_i: the fraction of the tokens (N, k) that chose expert i among their k (summing to k over i), no gradient."""
    return torch.zeros(n_experts, device=experts.device).index_add_(
        0, experts.flatten(), torch.ones(experts.numel(), device=experts.device)) / experts.shape[0]


def load_balance_loss(routing: Routing, n_experts: int, scores: str = "softmax") -> torch.Tensor:
    """The Switch Transformer / GShard load-balancing loss (Fedus et al. 2021, eq. 4) of one layer:

        L = E · Σ_i f_i · P_i,   f_i = (1/N) Σ_t 1[i ∈ TopK_t],   P_i = (1/N) Σ_t p_{i,t},

    over the N tokens of the forward, p the router's distribution (softmax; sigmoid scores
    normalised per token). With k = 1 this is Switch's (1 at uniform routing); for top-k f sums to
    k, as transformers' ``load_balancing_loss_func`` counts it (k at uniform routing). Gradients
    flow through P only."""
    f = routed_fraction(routing.experts, n_experts)
    P = normalised_scores(routing, scores).mean(dim=0)
    return n_experts * (f * P).sum()


def sequence_balance_loss(routing: Routing, n_experts: int, n_sequences: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (DeepSeek-AI 2024, eqs. 17-20), the mean over
    sequences of

        L = Σ_i f_i · P_i,   f_i = E / (k·T) Σ_t 1[i ∈ TopK_t],   P_i = (1/T) Σ_t s'_{i,t},

    s' each token's scores normalised to sum to 1 (s / Σ_j s_j), T the sequence's tokens; 1 at
    uniform routing. Gradients flow through P only."""
    N, k = routing.experts.shape
    experts = routing.experts.view(n_sequences, -1, k)
    T = experts.shape[1]
    hits = torch.zeros(n_sequences, n_experts, device=experts.device).scatter_add_(
        1, experts.flatten(1), torch.ones(n_sequences, T * k, device=experts.device))
    f = hits * n_experts / (k * T)
    s = routing.scores / routing.scores.sum(dim=-1, keepdim=True)
    P = s.view(n_sequences, T, n_experts).mean(dim=1)
    return (f * P).sum(dim=-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): (1/N) Σ_t (log Σ_j exp x_{j,t})², which keeps the
    router's logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


# --------------------------------------------------------------------------- reading a model's MoE layers


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in module order (through FSDP2 and compiled wrappers alike)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def clear(model: nn.Module) -> None:
    """Forget the last forward's records (before a micro-batch, so a forward that records nothing adds nothing)."""
    for m in moe_layers(model):
        m.aux_losses, m.last_load, m.last_dropped = {}, None, None


def aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each auxiliary loss of the last training forward, averaged over the model's MoE layers (with
    gradients): the terms a step adds to its loss; empty when no coefficient is set."""
    layers = moe_layers(model)
    sums: dict[str, torch.Tensor] = {}
    for m in layers:
        for name, value in m.aux_losses.items():
            sums[name] = sums[name] + value if name in sums else value
    return {name: value / len(layers) for name, value in sums.items()}


class LoadTracker:
    """Each MoE layer's expert load over a training step: ``add`` after each micro-batch's forward and
    backward sums its ``last_load`` and ``last_dropped``; ``finish_step`` (after the optimizer step)
    sums them over data-parallel ranks with ``all_reduce``, nudges each selection bias by
    γ·sign(mean load − load) (DeepSeek-V3's auxiliary-loss-free balancing; summed loads, so every rank
    moves its replica alike), keeps the step's figures for ``metrics`` and starts the next step."""

    def __init__(self, model: nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.layers = moe_layers(model)
        self.all_reduce = all_reduce or (lambda t: t)
        self.load: torch.Tensor | None = None  # (layers, E) tokens this step
        self.dropped: torch.Tensor | None = None  # (layers,)
        self.step_load: torch.Tensor | None = None
        self.step_dropped: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def add(self) -> None:
        loads = [m.last_load for m in self.layers]
        if any(load is None for load in loads):
            return
        load = torch.stack(loads).float()
        dropped = torch.stack([m.last_dropped for m in self.layers]).float()
        self.load = load if self.load is None else self.load + load
        self.dropped = dropped if self.dropped is None else self.dropped + dropped

    @torch.no_grad()
    def finish_step(self, update_bias: bool = True) -> None:
        """The step's loads over every rank; the bias nudged (``update_bias``: the optimizer step was taken)."""
        if self.load is None:
            return
        both = self.all_reduce(torch.cat((self.load, self.dropped[:, None]), dim=1))
        load, self.step_dropped = both[:, :-1], both[:, -1]
        self.step_load = load
        for m, layer_load in zip(self.layers, load):
            rate, bias = m.cfg.bias_update_rate, m.router.expert_bias
            if rate and bias is not None and update_bias:
                bias.add_(rate * torch.sign(layer_load.mean() - layer_load).to(bias.dtype))
        self.load = self.dropped = None

    def metrics(self) -> dict[str, float]:
        """Per MoE layer of the last finished step: the least and most loaded experts' shares of the
        assignments, the load's entropy (nats; ln E when balanced) and the assignments dropped."""
        if self.step_load is None:
            return {}
        out = {}
        for m, load, dropped in zip(self.layers, self.step_load, self.step_dropped):
            share = load / load.sum().clamp(min=1)
            entropy = -(share * share.clamp(min=1e-30).log()).sum()
            prefix = f"moe/layer{m.layer}"
            out |= {f"{prefix}/load_min": float(share.min()), f"{prefix}/load_max": float(share.max()),
                    f"{prefix}/entropy": float(entropy), f"{prefix}/dropped": float(dropped)}
        return out


def expert_weights(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The stacked expert matrices (name, parameter) of a model, which LoRA does not adapt."""
    for name, p in model.named_parameters():
        if ".experts.w" in name:
            yield name, p
