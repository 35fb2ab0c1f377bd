"""The Gemma 2 / Gemma 3 model, built from the shared parts of ``model.transformer``.

Against the Llama line: every norm is (1 + w) RMSNorm computed in float32; each branch is
normalised before and after (x + norm(attn(norm(x))), then the MLP alike); the MLP is GeGLU;
the embedding is scaled by √d; attention scores are scaled by ``query_pre_attn_scalar``^-1/2
and (Gemma 2) soft-capped, and so are the logits; Gemma 3 adds QK-norm and a RoPE base of its
own for the sliding layers. Cached decoding, pipeline stages and windows are the shared
``Transformer``'s (transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py`` are the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.families.gemma.config import GemmaConfig
from lmforge.model.rope import angle_tables, plain_inv_freq
from lmforge.model.transformer import Attention, Transformer, dropout


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · (1 + w), in float32, then cast back to x's dtype; the gain is stored
    as w, initialised to 0 (transformers' ``Gemma2RMSNorm``: the product is formed before the cast)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GeGLU(nn.Module):
    """Gemma's MLP: ``w2(gelu(w1 x) * w3 x)`` (Shazeer 2020), GELU in its tanh approximation
    (``gelu_pytorch_tanh``); the shared MLP's names, so LoRA targets and TP plans read alike."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class GemmaAttention(Attention):
    """The shared attention with Gemma's score scale and soft-cap, and its (1 + w) QK-norm (Gemma 3)."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__(cfg, layer)
        if cfg.query_pre_attn_scalar is not None:
            self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_softcap
        if cfg.qk_norm:
            self.q_norm, self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps), GemmaRMSNorm(cfg.head_dim, cfg.norm_eps)


class GemmaBlock(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x))); each branch dropped out in training."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.attn_norm = GemmaRMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = GemmaAttention(cfg, layer)
        self.post_attn_norm = GemmaRMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp_norm = GemmaRMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GeGLU(cfg)
        self.post_mlp_norm = GemmaRMSNorm(cfg.d_model, cfg.norm_eps)
        self.resid_dropout = cfg.resid_dropout

    def forward(self, x, rope, attn_mask=None, kv_cache=None):
        p = self.resid_dropout
        x = x + dropout(self.post_attn_norm(self.attn(self.attn_norm(x), rope, attn_mask, kv_cache)), p, self.training)
        return x + dropout(self.post_mlp_norm(self.mlp(self.mlp_norm(x))), p, self.training)


class Gemma(Transformer):
    """Embedding scaled by √d, Gemma blocks, a (1 + w) final norm, the head and (Gemma 2) soft-capped logits."""

    config_class = GemmaConfig
    block_class = GemmaBlock

    def __init__(self, cfg: GemmaConfig):
        super().__init__(cfg)
        self.norm = GemmaRMSNorm(cfg.d_model, cfg.norm_eps)  # in place of the shared RMSNorm, its gain 0 (1 + w = 1)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The shared initialisation, with every (1 + w) gain at w = 0, as transformers' ``_init_weights``."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.zero_()

    def embed_tokens(self, tokens: torch.Tensor, offset: int, positions: torch.Tensor | None) -> torch.Tensor:
        """The embeddings times √d_model, the factor rounded to the embedding's dtype first (55.43 is
        55.5 in bfloat16), as transformers' ``Gemma2TextScaledWordEmbedding``; dropped out in training."""
        x = self.embed(tokens)
        x = x * torch.tensor(self.cfg.d_model**0.5, device=x.device).to(x.dtype)  # float32, then x's dtype
        return dropout(x, self.cfg.embed_dropout, self.training)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits z, as c·tanh(z / c) with ``final_softcap`` c (Gemma 2)."""
        logits = super().logits(hidden)
        c = self.cfg.final_softcap
        return logits if c is None else torch.tanh(logits / c) * c

    def sliding_rope_at(self, offset: int, T: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Gemma 3's local layers: plain RoPE of base ``rope_local_theta`` (no scaling), computed for this
        forward's positions as transformers' rotary embedding computes its tables."""
        if self.cfg.rope_local_theta is None:
            return None
        device = self.rope_cos.device
        at = positions if positions is not None else torch.arange(offset, offset + T, device=device)[None]
        inv_freq = plain_inv_freq(self.cfg.rope_local_theta, self.cfg.head_dim, device)
        return self.as_table_dtype(angle_tables(inv_freq, 1.0, at))

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        """The shared plan, with the norms after each branch on their sequence shard too."""
        return {**super().tp_plan(block), "post_attn_norm": "output_norm", "post_mlp_norm": "output_norm"}
