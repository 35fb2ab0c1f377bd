"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", §2.1; DeepSeek-V3, §2.1.1).

Keys and values are compressed jointly into one latent per token, and every head reads its keys
and values back from it; a small RoPE key, shared by all heads, carries the positions::

    c_t = RMSNorm(W_DKV h_t)                      (kv_lora_rank)
    k_t^R = RoPE(W_KR h_t)                        (qk_rope_head_dim, one for every head)
    [k_t,i^C ; v_t,i] = W_UKV,i c_t               (qk_nope_head_dim ; v_head_dim, per head i)
    q_t,i = [q_t,i^C ; RoPE(q_t,i^R)]             from W_Q h_t, or W_UQ RMSNorm(W_DQ h_t) (q_lora_rank)
    o_t,i = Σ_j softmax_j(q_t,i · [k_j,i^C ; k_j^R] · scale) v_j,i,     u_t = W_O [o_t,1 ; ... ; o_t,H]

``W_DKV`` and ``W_KR`` are one projection (``wkv_a``, transformers' ``kv_a_proj_with_mqa``), and so
are the key and value up-projections (``wkv_b``). The scale is 1/sqrt(qk_nope_head_dim +
qk_rope_head_dim), times YaRN's mscale² where the RoPE is YaRN with DeepSeek's ``mscale_all_dim``
(``softmax_scale``). A cache (``latent_cache``) keeps only c_t and k_t^R of each token; a decoding
step attends in the absorbed form, ``W_UK`` folded into the query and ``W_UV`` into the output
(``MLA.absorbed_attention``: the same scores and outputs, without expanding the cache into keys
and values per head). Transformers' ``DeepseekV3Attention`` is the numeric reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.model.config import ModelConfig
from lmforge.model.kv_cache import KVCache, new_cache
from lmforge.model.transformer import apply_rope, attend

LATENT_NORM_EPS = 1e-6  # the compressed q's and kv's RMSNorm: DeepSeek's (and transformers') constant, not rms_norm_eps


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's 0.1·mscale·ln s + 1 for a context stretched s times (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """The scores' scale: (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times mscale(s, mscale_all_dim)² under
    YaRN with DeepSeek's ``rope_mscale_all_dim`` (transformers' ``yarn_apply_mscale``): the RoPE tables carry
    mscale(s, mscale) / mscale(s, mscale_all_dim) on q and on k, so the logits' temperature is mscale(s, mscale)²."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rotate_interleaved(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE over interleaved pairs (x_2i, x_2i+1), DeepSeek's layout (``rope_interleave``), from the tables
    of ``transformer.rotation_tables``: (x_e cos − x_o sin ; x_o cos + x_e sin), each pair's two rotated parts
    as the halves, as transformers' ``apply_rotary_pos_emb_interleave`` writes them. q and k come out in the
    same order, so their dot products are the pairs'; the cache holds keys so. Real arithmetic, no complex
    numbers (torch.compile's inductor has no kernels for them)."""
    cos, sin = rope  # (cos, cos) and (−sin, sin) over the halves
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., half:]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).type_as(x)


class MLA(nn.Module):
    """Multi-head latent attention over the shared ``attend`` (see the module docstring).

    Reads from its config: ``d_model``, ``n_heads``, ``q_lora_rank`` (None: one query projection
    ``wq``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``qkv_bias``
    (biases on the down-projections ``wq_a`` and ``wkv_a``, DeepSeek's ``attention_bias``), ``out_bias``
    ``attn_dropout`` and ``rope_interleave`` (``rotate_interleaved``, else the halves of ``apply_rope``). ``absorb`` chooses the form: None (the default) attends in the absorbed form for
    a one-token step against a cache and expands the latents otherwise; True or False forces one."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads = layer, cfg.n_heads
        self.rotate = rotate_interleaved if cfg.rope_interleave else apply_rope
        self.n_kv_heads = cfg.n_heads  # every head reads its own keys and values from the latent
        self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                           cfg.kv_lora_rank)
        qk = self.nope + self.rope_dim
        d, h = cfg.d_model, cfg.n_heads
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(d, h * qk, bias=False)
            self.wq_a = self.q_a_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, self.rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = nn.RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=cfg.out_bias)
        self.scale = softmax_scale(cfg)
        self.dropout = cfg.attn_dropout  # on the attention probabilities, in training
        self.absorb: bool | None = None

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """Queries (B, T, heads · (qk_nope_head_dim + qk_rope_head_dim)): W_Q x, or W_UQ RMSNorm(W_DQ x)."""
        return self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.project_q(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        latent, k_rope = self.wkv_a(x).split((self.rank, self.rope_dim), dim=-1)
        latent = self.kv_a_norm(latent)[:, None]  # (B, 1, T, kv_lora_rank): one latent for every head
        q_rope, k_rope = self.rotate(q_rope, rope), self.rotate(k_rope[:, None], rope)
        if kv_cache is not None:  # a latent cache (``latent_cache``): the latent as its "k", the RoPE key as its "v"
            latent, k_rope = kv_cache.store(self.layer, latent, k_rope)
        # Without a mask, causal when queries and keys are the same positions (as the shared attention)
        is_causal = attn_mask is None and T > 1
        dropout = self.dropout if self.training else 0.0
        absorb = self.absorb if self.absorb is not None else kv_cache is not None and T == 1
        if absorb and type(self.wkv_b) is nn.Linear:  # an adapter's or a quantised wkv_b expands the latents
            y = self.absorbed_attention(q_nope, q_rope, latent, k_rope, attn_mask, is_causal, kv_cache is not None, dropout)
        else:
            y = self.expanded_attention(q_nope, q_rope, latent, k_rope, attn_mask, is_causal, kv_cache is not None, dropout)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def expanded_attention(self, q_nope, q_rope, latent, k_rope, attn_mask, is_causal, decoding, dropout) -> torch.Tensor:
        """The paper's form: every key's latent up-projected to its per-head k^C and v, then attention over
        q = [q^C ; q^R] and k = [k^C ; k^R]. (B, heads, T, v_head_dim)."""
        B, _, S, _ = latent.shape
        kv = self.wkv_b(latent).view(B, S, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.n_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attend(q, k, v, attn_mask, is_causal, decoding, scale=self.scale, dropout=dropout)

    def absorbed_attention(self, q_nope, q_rope, latent, k_rope, attn_mask, is_causal, decoding, dropout) -> torch.Tensor:
        """The absorbed form (DeepSeek-V2 §2.1.2): q^C · W_UK c = (W_UKᵀ q^C) · c, so each head's query moves into
        the latent space and attends over [c ; k^R] with the latents themselves as values; W_UV then maps each
        head's latent output to its values' space. Every head reads the same keys, so the heads' queries are one
        head's rows (B, 1, heads · T, ...) against the cache as it is, never repeated per head (grouped-query
        attention would copy it H times); the mask is the same for each head's rows. Equal to
        ``expanded_attention`` up to float rounding; (B, heads, T, v_head_dim)."""
        B, H, T, _ = q_nope.shape
        w = self.wkv_b.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), dim=-1)
        k = torch.cat((latent, k_rope), dim=-1)  # (B, 1, S, kv_lora_rank + qk_rope_head_dim)
        S = k.shape[2]
        if attn_mask is None and is_causal:  # causal over positions, not over the heads' rows joined
            attn_mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        if attn_mask is not None:  # (T, S) or (B or 1, 1, T, S) -> (B or 1, 1, heads · T, S), heads outermost
            mask = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None]
            attn_mask = mask.expand(mask.shape[0], H, T, S).reshape(mask.shape[0], 1, H * T, S)
        y = attend(q.reshape(B, 1, H * T, -1), k, latent, attn_mask, False, decoding, scale=self.scale, dropout=dropout)
        return torch.einsum("bhtr,hvr->bhtv", y.view(B, H, T, self.rank), w_uv)


def latent_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                 kv_dtype: str = "auto", layers: range | None = None) -> KVCache:
    """A cache of MLA's compressed latents and RoPE keys (``kv_cache.new_cache`` of storage ``kv_dtype``): per
    layer and position one "head" whose ``k`` is c_t (kv_lora_rank, after its norm) and whose ``v`` is k_t^R
    (qk_rope_head_dim, rotated), shared by every query head; the protocol's writes, row selection, merging and
    quantised storage apply unchanged. Every layer attends to every position: no ring."""
    return new_cache(kv_dtype, layers=layers or range(cfg.n_layers), batch=batch, heads=1, widths=(cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                     max_len=max_len, window=None, dtype=dtype, device=device)


def cache_bytes_per_token(cfg: ModelConfig, element_bytes: int, gqa_kv_heads: int | None = None) -> dict[str, int]:
    """Bytes one token adds to the cache, over every layer, for MLA (its latent and RoPE key,
    (kv_lora_rank + qk_rope_head_dim) elements a layer) against multi-head attention of the same width
    (keys and values of n_heads heads of d_model / n_heads: 2·d_model elements a layer) and grouped-query
    attention of ``gqa_kv_heads`` such heads (default n_heads / 8, at least 1: Llama 3's 64 of 8)."""
    kv_heads = gqa_kv_heads if gqa_kv_heads is not None else max(1, cfg.n_heads // 8)
    head_dim = cfg.d_model // cfg.n_heads
    per_layer = {"mla": cfg.kv_lora_rank + cfg.qk_rope_head_dim, "mha": 2 * cfg.n_heads * head_dim,
                 "gqa": 2 * kv_heads * head_dim}
    return {name: cfg.n_layers * n * element_bytes for name, n in per_layer.items()}
