"""OLMo 2's blocks, built from the shared parts: the shared attention with QK-norm over the whole
q and k projections, and a block whose norms follow its branches (the reordered residual)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import ConfigError
from lmforge.model.families.olmo2.config import Olmo2Config
from lmforge.model.transformer import MLP, Attention, Transformer, dropout, make_norm, rotation_pair_order


class Olmo2Attention(Attention):
    """The shared attention, with one RMSNorm over the whole q projection (n_heads·head_dim wide) and one
    over k's, before the heads are split: each head's scale depends on every head's values."""

    def __init__(self, cfg: Olmo2Config, layer: int):
        super().__init__(cfg, layer)
        self.q_proj_norm = nn.RMSNorm(cfg.n_heads * cfg.head_dim, eps=cfg.norm_eps)
        self.k_proj_norm = nn.RMSNorm(cfg.n_kv_heads * cfg.head_dim, eps=cfg.norm_eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        if self.wqkv is None:
            return self.q_proj_norm(q), self.k_proj_norm(k), v
        # The decoding layout (model.fused) joins q/k/v with each head's columns in RoPE pair order: the
        # mean of squares over the whole projection is the same, and each column's gain is read in that order.
        return in_pair_order(self.q_proj_norm, q, self.n_heads), in_pair_order(self.k_proj_norm, k, self.n_kv_heads), v


def in_pair_order(norm: nn.RMSNorm, x: torch.Tensor, heads: int) -> torch.Tensor:
    """``norm`` over a projection whose heads' columns are in rotation-pair order (``rotation_pair_order``)."""
    order = pair_order(x.shape[-1] // heads, heads, x.device)
    return F.rms_norm(x, norm.normalized_shape, norm.weight[order], norm.eps)


@functools.cache
def pair_order(head_dim: int, heads: int, device: torch.device) -> torch.Tensor:
    return rotation_pair_order(head_dim, heads).to(device)


class Olmo2Block(nn.Module):
    """No norm before a branch, one after it: x + norm(attn(x)), then h + norm(mlp(h)); each branch's
    output dropped out in training."""

    def __init__(self, cfg: Olmo2Config, layer: int):
        super().__init__()
        self.attn = Olmo2Attention(cfg, layer)
        self.post_attn_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)
        self.post_mlp_norm = make_norm(cfg, cfg.d_model)
        self.resid_dropout = cfg.resid_dropout

    def forward(self, x, rope, attn_mask=None, kv_cache=None):
        p = self.resid_dropout
        x = x + dropout(self.post_attn_norm(self.attn(x, rope, attn_mask, kv_cache)), p, self.training)
        return x + dropout(self.post_mlp_norm(self.mlp(x)), p, self.training)


class Olmo2(Transformer):
    """The shared embedding, final norm and head around OLMo 2's blocks."""

    config_class = Olmo2Config
    block_class = Olmo2Block

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        raise ConfigError("tensor parallelism does not support model family 'olmo2': its QK-norm normalises the whole "
                          "q and k projections, which a rank holding some heads cannot compute without a reduction "
                          "across ranks; set parallel.tp = 1 (FSDP and pipeline parallelism apply)")
