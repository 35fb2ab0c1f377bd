"""What a model shape costs: its parameters by kind, its training FLOPs per token, the time a
number of tokens takes at a given utilization, and the shape that has a wanted parameter count."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lmforge.model.config import ModelConfig

# What a plan may ask a recipe for: far past any model trained (~1e12 parameters, ~1e13 tokens,
# ~1e26 FLOPs), short of sizes whose widths and step counts no longer fit the model's integers
MAX_PLAN_FLOPS = 1e36
MAX_PLAN_PARAMS = 1e15
MAX_PLAN_TOKENS = 1e18


@dataclass
class ParameterCounts:
    total: int
    embedding: int  # the token embedding
    head: int  # the output matrix (0 when tied to the embedding)
    non_embedding: int  # all but embedding and head: Kaplan et al. 2020's N, the runs CSV's params
    active: int  # used per token: the total for these dense models (no mixture of experts)


def count_parameters(model: ModelConfig) -> ParameterCounts:
    total = model.num_params()
    embedding = model.vocab_size * model.d_model
    head = 0 if model.tie_embeddings else embedding
    return ParameterCounts(total, embedding, head, total - embedding - head, total)


@dataclass
class FlopsPerToken:
    """Training FLOPs per token = 6·(matmul weights) + the attention term, as ``ModelConfig.flops_per_token``
    counts them (PaLM, App. B: 12·L·H·Dh·T, both attention products, causal mask ignored; Kaplan et
    al.'s 6·L·T·d_attn counts the score product only, so half this term)."""

    total: int
    dense: int  # 6 × the weights that take part in matmuls (the head included)
    attention: int
    six_n: int  # 6 × non-embedding N, the C = 6·N·D of the fits


def flops_per_token(model: ModelConfig, seq_len: int) -> FlopsPerToken:
    total = model.flops_per_token(seq_len)
    dense = 6 * model.matmul_params()
    return FlopsPerToken(total, dense, total - dense, 6 * count_parameters(model).non_embedding)


def training_seconds(flops: float, peak_flops: float, devices: int, mfu: float) -> float:
    """Wall-clock seconds for ``flops`` on ``devices`` running at ``mfu`` of ``peak_flops`` each."""
    return flops / (peak_flops * devices * mfu)


def budget_flops(peak_flops: float, devices: int, hours: float, mfu: float) -> float:
    """Training FLOPs a cluster delivers: peak × devices × seconds × MFU."""
    return peak_flops * devices * hours * 3600.0 * mfu


def _repeated(pattern: list | None, n_layers: int) -> list | None:
    """A per-layer pattern (sliding and full layers) stretched or cut to ``n_layers`` by repeating it."""
    return None if pattern is None else [pattern[i % len(pattern)] for i in range(n_layers)]


def shape_for_params(target: float, template: ModelConfig, *, aspect_ratio: float = 64.0, head_dim: int = 64,
                     which: str = "non_embedding", tolerance: float = 0.1) -> ModelConfig:
    """A model like ``template`` (vocabulary, MLP kind, norms ...) resized to about ``target``
    parameters (``which``: non_embedding or total): for each depth, the width (a multiple of
    ``head_dim``) nearest the target; among shapes within ``tolerance``, the one whose
    d_model / n_layers is nearest ``aspect_ratio`` (Kaplan et al. 2020, Fig. 5: loss depends
    little on shape over a wide range of it), else the nearest in count. The template's family
    and its per-layer pattern (``layer_types``, repeated to each depth) are kept."""
    base = {f.name: getattr(template, f.name) for f in dataclasses.fields(template)}
    base.update(preset=None, n_kv_heads=None, head_dim=None, ffn_hidden=None)
    best, best_key = None, None
    for n_layers in range(1, 129):
        guess = math.sqrt(max(target, 1.0) / (12 * n_layers))
        for mult in {max(1, math.floor(guess / head_dim)), max(1, math.ceil(guess / head_dim))}:
            d = mult * head_dim
            cfg = type(template)(**{**base, "d_model": d, "n_layers": n_layers, "n_heads": mult,
                                    "layer_types": _repeated(template.layer_types, n_layers)})
            count = getattr(count_parameters(cfg), which)
            error = abs(math.log(count / target))
            key = (error > math.log1p(tolerance), abs(math.log(d / n_layers / aspect_ratio)) if
                   error <= math.log1p(tolerance) else error)
            if best_key is None or key < best_key:
                best, best_key = cfg, key
    return best
