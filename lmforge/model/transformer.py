"""A decoder-only transformer in the Llama line: pre-norm blocks, RoPE, GQA, SwiGLU.

Read top to bottom like the paper: ``Attention`` and ``MLP`` make a ``Block``; blocks
make the ``Transformer``. Variants (GELU MLP, LayerNorm, QK-norm, biases, sliding-window
layers, ALiBi in place of RoPE) are chosen by ``ModelConfig``; windows and ALiBi's bias are
attention masks built once per forward (``Transformer.layer_masks``) for the one ``attend``.
Parallelism and activation checkpointing are applied from outside.

``Transformer.forward`` is the model's only arithmetic: training, evaluation, generation
(with a ``KVCache``) and every pipeline stage (``keep_layers``) run it. A decoding layout
(``model.fused``) swaps modules of the same tree for joined ones that this forward calls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.config import ModelConfig
from lmforge.model.kv_cache import KVCache, new_cache
from lmforge.model.mtp import MTPModule, MTPModules, MTPTargets, depth_targets, multi_token_loss
from lmforge.model.rope import LENGTH_DEPENDENT, rope_tables, tables_at


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width tables (B or 1, T, D/2) -> full-width (B or 1, 1, T, D) as (cos, cos) and (-sin, sin).

    Built once per forward so that each layer's rotation is two multiplies and an add.
    """
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def pair_rotations(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-width tables (B or 1, T, D/2) -> the unit complex numbers cos θ + i sin θ, (B or 1, 1, T, D/2),
    in float32 (complex numbers of 16-bit parts have no kernels; a 16-bit model's tables are upcast exactly)."""
    return torch.complex(cos.float(), sin.float()).unsqueeze(1)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by position-dependent angles; x is (B, H, T, D).

    With ``rotation_tables``' (cos, sin), heads are in the model's halves order (as HF Llama's):
    ``x.roll`` swaps the halves, so this is ``(x1 cos - x2 sin, x2 cos + x1 sin)``. With
    ``pair_rotations``' complex table, heads are in rotation-pair order (``Transformer.rope_pairs``:
    x_i and x_{i+d/2} side by side, as a decoding layout stores them), and each pair, read as
    the complex number x_i + i x_{i+d/2}, is multiplied by cos θ + i sin θ: the same products
    and sums in one operator, in float32 whatever ``x``'s dtype (as the halves' with float32 tables).
    """
    if isinstance(rope, torch.Tensor):
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * rope).flatten(-2).type_as(x)
    cos, sin = rope
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).type_as(x)


def rotation_pair_order(head_dim: int, heads: int) -> torch.Tensor:
    """The index that puts each head's RoPE pairs (i, i + head_dim/2) side by side: column
    ``order[j]`` of the halves order is column j of the pair order (``apply_rope``)."""
    half = torch.arange(head_dim // 2)
    pairs = torch.stack((half, half + head_dim // 2), dim=-1).flatten()
    return (torch.arange(heads)[:, None] * head_dim + pairs).flatten()


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022): for n a power of 2, the geometric sequence
    2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise those of the closest power of 2 below n, then
    every other slope of twice that power for the remaining heads (the reference code's rule,
    as BLOOM's ``build_alibi_tensor``)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * min(closest, n_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def check_length(cfg: ModelConfig, offset: int, T: int) -> None:
    if offset + T > cfg.max_seq_len:
        raise ValueError(f"sequence of {offset + T} tokens exceeds max_seq_len {cfg.max_seq_len}")


def cached_prefix_mask(attn_mask: torch.Tensor | None, offset: int, T: int, device: torch.device) -> torch.Tensor | None:
    """``attn_mask``, or for several new tokens after ``offset`` cached ones the causal mask
    aligned bottom-right (SDPA's ``is_causal`` aligns top-left)."""
    if attn_mask is None and offset > 0 and T > 1:
        return torch.ones(T, offset + T, dtype=torch.bool, device=device).tril(diagonal=offset)
    return attn_mask


def positions_and_mask(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions counted from each row's first real token, and the (B, 1, T, T) boolean
    attention mask (causal, real keys only) for left- or right-padded rows.

    A padding query may attend to itself, so its softmax has a key and never yields NaN;
    its output is never read.
    """
    real = attention_mask.bool()
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & real[:, None, :]
    mask = mask | torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    return positions, mask[:, None]


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's private probe; False where torch lacks it)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


CPU_HAS_AMX = cpu_has_amx()  # read once: a constant to torch.compile


def slow_16bit_kernels(dtype: torch.dtype, device_type: str) -> bool:
    """Whether ``dtype`` is bf16/fp16 on a CPU without AMX, where PyTorch's 16-bit attention over
    whole sequences runs slower than float32's on the same values (``attend``)."""
    return device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not CPU_HAS_AMX


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    decoding: bool = False, *, scale: float | None = None, softcap: float | None = None, dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(q kᵀ · scale + mask) v through ``F.scaled_dot_product_attention``, in q's dtype (or autocast's);
    ``scale`` defaults to 1/√d. ``dropout`` drops attention probabilities (training only: the
    caller passes 0 in evaluation). ``softcap`` c bounds each score s to c·tanh(s / c) before the
    mask (Gemma 2), which no fused kernel offers: that route computes the scores explicitly.

    On a CPU without AMX, 16-bit attention over whole sequences (training, evaluation, a
    reference model's scores) runs on the same values upcast to float32: PyTorch's CPU
    flash-attention kernel is fast in bf16/fp16 only with AMX tiles, and without them the
    16-bit forward and backward took 1.1-1.8x as long as float32's on the same values
    (``benchmarks/attention.py``). The upcast is exact and the float32 kernel keeps the
    softmax probabilities in float32 where the 16-bit one rounds them, so the result, cast
    back, is at least as accurate. Every full-sequence pass takes the same route, with or
    without gradients, so a policy and its no-grad reference compute alike (DPO starts at
    exactly ln 2). ``decoding`` (a step against a KV cache), GPUs and AMX CPUs keep the 16-bit
    kernel: a decode step has no backward to win back its copies (it took ~4x as long).
    """
    gqa = k.shape[1] != q.shape[1]
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    if softcap is not None:
        return capped_attention(q, k, v, attn_mask, is_causal, scale, softcap, dropout, dtype)
    fast = decoding or not slow_16bit_kernels(dtype, device)
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != (dtype if fast else torch.float32):
        attn_mask = attn_mask.to(dtype if fast else torch.float32)  # a float mask (ALiBi's bias) in the kernel's dtype
    if fast:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa,
                                              scale=scale, dropout_p=dropout)
    with torch.autocast(device, enabled=False):
        q32, k32, v32 = q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float()
        y = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa,
                                           scale=scale, dropout_p=dropout)
    return y.to(dtype)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                     scale: float | None, softcap: float, dropout: float, dtype: torch.dtype) -> torch.Tensor:
    """``attend`` with soft-capped scores, c·tanh(q kᵀ · scale / c), then the mask, a float32
    softmax and the values (transformers' eager Gemma 2 attention computes the same)."""
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = softcap * torch.tanh(scores / softcap)
        if is_causal:
            attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask.float()
        probs = F.dropout(scores.softmax(dim=-1), p=dropout) if dropout else scores.softmax(dim=-1)
        return (probs.to(dtype) @ v).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads, self.head_dim = layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.out_bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.attn_dropout  # on the attention probabilities, in training
        # a family's attention may set these (Gemma: query_pre_attn_scalar^-1/2, attention soft-capping); see ``attend``
        self.scale: float | None = None  # the scores' scale; None = 1/sqrt(head_dim)
        self.softcap: float | None = None  # c of c·tanh(score / c); None = no cap
        self.wqkv: nn.Module | None = None  # wq, wk, wv joined into one projection (``model.fused``), else None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, T, heads * head_dim each): three projections, or one joined one split in three."""
        if self.wqkv is None:
            return self.wq(x), self.wk(x), self.wv(x)
        kv = self.n_kv_heads * self.head_dim
        return self.wqkv(x).split((self.n_heads * self.head_dim, kv, kv), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # ALiBi has no rotation; its bias is in attn_mask
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv_cache is not None:
            k, v = kv_cache.store(self.layer, k, v)
        # Without a mask, causal when queries and keys are the same positions; a single new
        # token may see the whole cache (``hidden_states`` masks a multi-token step after a prefix).
        is_causal = attn_mask is None and T > 1
        y = attend(q, k, v, attn_mask, is_causal, decoding=kv_cache is not None, scale=self.scale,
                   softcap=self.softcap, dropout=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU, ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020), or GELU, ``w2(gelu(w1 x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.ffn == "swiglu"
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.mlp_bias) if self.gated else None
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=cfg.mlp_bias)
        self.w13: nn.Module | None = None  # w1 and w3 joined into one projection (``model.fused``), else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        if self.w13 is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout`` in training when ``p`` > 0; otherwise ``x`` itself (no kernel, no copy)."""
    return F.dropout(x, p) if p and training else x


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); each branch's output dropped out in training."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)
        self.resid_dropout = cfg.resid_dropout

    def forward(self, x, rope, attn_mask=None, kv_cache=None):
        p = self.resid_dropout
        x = x + dropout(self.attn(self.attn_norm(x), rope, attn_mask, kv_cache), p, self.training)
        return x + dropout(self.mlp(self.mlp_norm(x)), p, self.training)


class Transformer(nn.Module):
    """Embedding, blocks, final norm, LM head. On a pipeline stage (``keep_layers``) the parts
    the stage does not own are None (``layers`` keeps the owned blocks under their indices) and
    ``forward`` skips them: token ids in on the first stage, hidden states in on the others.

    A family's model (``model.family``) is this class or a subclass that names its config
    class and block class and, where its arithmetic differs around the blocks, overrides
    ``embed_tokens`` or ``logits``, or ``sliding_rope_at`` where its sliding layers rotate by RoPE
    of their own, or ``new_kv_cache`` where its attention caches other quantities than keys and
    values; ``lmforge.model.families.build`` makes the right one."""

    config_class: type[ModelConfig] = ModelConfig
    block_class: type[nn.Module] = Block

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if type(cfg) is not self.config_class:
            raise TypeError(f"{type(self).__name__} is built from a {self.config_class.__name__}, got a "
                            f"{type(cfg).__name__} (family {cfg.family!r}): use lmforge.model.families.build(cfg)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(self.block_class(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.sliding = cfg.sliding_layers()  # per layer: attends within cfg.sliding_window only
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # multi-token prediction (``model.mtp``): depth k's block has the layer index n_layers + k - 1
        self.mtp = MTPModules([MTPModule(cfg.d_model, cfg.norm_eps, self.block_class(cfg, cfg.n_layers + k))
                               for k in range(cfg.mtp.depth)], cfg.mtp.loss_weight) if cfg.mtp.enabled else None
        self.rope_pairs = False  # q/k head columns in rotation-pair order (a decoding layout, ``model.fused``)
        self.output_mult = 1.0 / cfg.width_mult()  # µP's readout multiplier (model.mup); 1 in the standard parameterisation
        if cfg.mup.base_head_dim is not None:  # µP's 1/head_dim scores: the family's scale times √(base_head_dim / head_dim)
            for block in self.blocks():
                block.attn.scale = (block.attn.scale or cfg.head_dim**-0.5) * math.sqrt(cfg.mup.base_head_dim / cfg.head_dim)
        self.init_weights()

    def blocks(self) -> list[nn.Module]:
        """Every block: the model's layers, then the MTP modules' (``model.mtp``)."""
        return [*self.layers.children(), *(m.block for m in (self.mtp or ()))]

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 / Llama practice: N(0, init_std), residual projections scaled by 1/sqrt(2·layers), zero biases;
        under µP (``model.mup``) the blocks' matrices by 1/√m more, so their variance goes as 1/fan_in."""
        std = self.cfg.init_std
        hidden_std = std / math.sqrt(self.cfg.width_mult())
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 1:  # norm gains
                nn.init.ones_(p)
            elif name.endswith(("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight")):  # residual
                nn.init.normal_(p, 0.0, hidden_std / math.sqrt(2 * self.cfg.n_layers))
            elif name.startswith(("layers.", "mtp.")):
                nn.init.normal_(p, 0.0, hidden_std)
            else:  # embeddings and the head
                nn.init.normal_(p, 0.0, std)
        cos, sin = rope_tables(self.cfg, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states (B, T, d_model) of token ids (B, T), or, on a pipeline
        stage without the embedding, of the previous stage's hidden states (B, T, d_model);
        on a stage without the final norm, the last block's output.

        ``positions`` (B, T) restarts RoPE per packed document or skips left padding;
        ``attn_mask`` (B, 1, T, S) boolean, True = may attend, its S keys those of
        ``KVCache.key_times`` (every position so far, unless a ring cache wraps); ``kv_cache`` for decoding.
        """
        T = tokens.shape[1]
        offset = kv_cache.length if kv_cache is not None else 0
        rope, sliding_rope, full, sliding = self.attention_inputs(offset, T, positions, attn_mask, kv_cache, tokens.device)
        x = self.embed_tokens(tokens, offset, positions) if self.embed is not None else tokens
        if sliding is full and sliding_rope is rope:  # every layer alike (no window this step reaches past, one RoPE)
            for block in self.layers.children():
                x = block(x, rope, full, kv_cache)
        else:
            for name, block in self.layers.named_children():
                slides = self.sliding[int(name)]
                x = block(x, sliding_rope if slides else rope, sliding if slides else full, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
        return self.norm(x) if self.norm is not None else x

    def attention_inputs(self, offset: int, T: int, positions: torch.Tensor | None, attn_mask: torch.Tensor | None,
                         kv_cache: KVCache | None, device: torch.device) -> tuple:
        """What every block of a forward of ``T`` positions after ``offset`` cached ones reads, built once:
        the RoPE rotation of the full and of the sliding layers (None without RoPE) and their masks."""
        rope = sliding_rope = None
        if self.cfg.positions == "rope":
            rotations = pair_rotations if self.rope_pairs else rotation_tables
            rope = rotations(*self.rope_at(offset, T, positions))
            local = self.sliding_rope_at(offset, T, positions)
            sliding_rope = rope if local is None else rotations(*local)
        else:
            check_length(self.cfg, offset, T)
        full, sliding = self.layer_masks(attn_mask, offset, T, kv_cache, device)
        return rope, sliding_rope, full, sliding

    def mtp_hidden(self, depth: int, previous: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                   attn_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """MTP depth ``depth``'s hidden states h^k (B, T, d_model), before its norm (``model.mtp``): its block over
        M_k [RMSNorm(Emb(tokens)) ; RMSNorm(previous)], ``previous`` the depth before's h^(k-1) at the same
        T positions (the model's final hidden states at depth 1) and ``tokens`` the ids k places ahead of
        them; ``positions``, ``attn_mask`` and ``kv_cache`` (the MTP modules' own) as ``hidden_states``'."""
        module = self.mtp[depth - 1]
        T = tokens.shape[1]
        offset = kv_cache.length if kv_cache is not None else 0
        rope, _, full, _ = self.attention_inputs(offset, T, positions, attn_mask, kv_cache, tokens.device)
        h = module.block(module.join(self.embed_tokens(tokens, offset, positions), previous), rope, full, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
        return h

    def mtp_logits(self, depth: int, hidden: torch.Tensor) -> torch.Tensor:
        """The shared head's logits of MTP depth ``depth``'s hidden states, after that depth's own norm."""
        return self.logits(self.mtp[depth - 1].norm(hidden))

    def embed_tokens(self, tokens: torch.Tensor, offset: int, positions: torch.Tensor | None) -> torch.Tensor:
        """The residual stream's start (B, T, d_model): the tokens' embeddings, plus learned position
        embeddings (``positions``, or ``offset`` .. ``offset + T``) where the model has them; dropped out in training."""
        x = self.embed(tokens)
        if self.pos_embed is not None:
            at = positions if positions is not None else torch.arange(offset, offset + tokens.shape[1], device=tokens.device)[None]
            x = x + self.pos_embed(at)  # (B or 1, T, d): the sequence on dim 1, as tensor parallelism splits it
        return dropout(x, self.cfg.embed_dropout, self.training)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of final hidden states (a family may transform them, e.g. soft-capping);
        under µP the head's input is scaled by its output multiplier 1/m first (the same, without a bias)."""
        return self.lm_head(hidden if self.output_mult == 1.0 else hidden * self.output_mult)

    def new_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
                     kv_dtype: str = "auto", layers: range | None = None) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` positions, stored as ``kv_dtype``
        (``kv_cache.KV_CACHE_DTYPES``; ``auto``: ``dtype``), read by attention in ``dtype``: every layer's
        keys and values, (kv_heads, head_dim) each per position, in a ring of ``sliding_window``
        slots when every layer slides. How the engine makes a model's cache, and so a family's hook:
        one whose attention caches other quantities (a latent cache) overrides this with
        ``kv_cache.new_cache`` of its own heads and widths, and its attention's ``kv_cache.store``
        returns them; the engine then needs nothing more (the ``KVCache`` protocol). ``layers``: the
        layer indices cached (default every layer; ``range(n_layers, n_layers + D)``: the MTP modules')."""
        cfg = self.cfg
        window = cfg.sliding_window if all(cfg.sliding_layers()) and layers is None else None
        return new_cache(kv_dtype, layers=layers or range(cfg.n_layers), batch=batch, heads=cfg.n_kv_heads,
                         widths=(cfg.head_dim, cfg.head_dim), max_len=max_len, window=window, dtype=dtype, device=device)

    def layer_masks(self, attn_mask: torch.Tensor | None, offset: int, T: int, kv_cache: KVCache | None,
                    device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The attention masks of full and of sliding layers, built once per forward.

        Without a window or ALiBi this is the caller's ``attn_mask`` (or the causal mask of several
        new tokens after a cache, ``cached_prefix_mask``), and None keeps SDPA's causal kernel.
        A sliding layer's query at time i also sees only keys j > i - sliding_window (transformers'
        ``sliding_window_overlay``: the window counts the query itself), a mask built only when
        some key this step reads lies outside some query's window. ALiBi turns each mask into
        a float one: -slope_h (i - j) where a key is seen, -inf where not. Times are columns of
        the sequence (the cache's ``key_times``): within a packed document or a left-padded
        row they differ as its positions do.
        """
        base = cached_prefix_mask(attn_mask, offset, T, device)
        window, alibi = self.cfg.sliding_window, self.cfg.positions == "alibi"
        if window is None and not alibi:
            return base, base
        if kv_cache is not None:
            key_times, first = kv_cache.key_times(T, device)
        else:
            key_times, first = torch.arange(T, device=device), 0
        query_times = torch.arange(offset, offset + T, device=device)[:, None]
        if attn_mask is None and T > 1 and kv_cache is not None and kv_cache.wraps(T):
            base = key_times <= query_times  # a ring's kept keys then the new ones
        full = sliding = base
        if window is not None and offset + T - 1 - first >= window and any(self.sliding):
            seen = (key_times <= query_times) & (key_times > query_times - window)
            sliding = seen if attn_mask is None else attn_mask & seen
        if not alibi:
            return full, sliding
        distance = (query_times - key_times).float()  # (T, S)
        bias = -alibi_slopes(self.cfg.n_heads).to(device)[:, None, None] * distance  # (H, T, S), float32

        def biased(mask: torch.Tensor | None) -> torch.Tensor:
            seen = mask if mask is not None else (distance >= 0) if T > 1 else None
            return bias if seen is None else bias.masked_fill(~seen, float("-inf"))

        return (biased(full), biased(sliding)) if sliding is not full else (biased(full),) * 2

    def rope_at(self, offset: int, T: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B or 1, T, head_dim / 2) of this forward's positions (``offset`` .. ``offset + T``, or
        ``positions``): rows of the model's tables. A length-dependent RoPE (dynamic NTK, LongRoPE) past
        ``rope_original_max_seq_len`` takes the frequencies of each row's length, its last position + 1,
        as transformers' ``dynamic_rope_update`` does at every forward (it takes the batch's longest);
        a cached decoding step rotates its new keys so, and the cached ones keep their rotation."""
        length_dependent = self.cfg.rope_scaling in LENGTH_DEPENDENT
        if positions is None:
            check_length(self.cfg, offset, T)
            if length_dependent and offset + T > self.cfg.rope_original_max_seq_len:
                steps = torch.arange(offset, offset + T, device=self.rope_cos.device)[None]
                return self.as_table_dtype(tables_at(self.cfg, steps, seq_len=offset + T))
            return self.rope_cos[offset : offset + T][None], self.rope_sin[offset : offset + T][None]
        if length_dependent:
            return self.as_table_dtype(tables_at(self.cfg, positions, seq_len=positions.amax(dim=-1) + 1))
        return self.rope_cos[positions], self.rope_sin[positions]

    def sliding_rope_at(self, offset: int, T: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin (B or 1, T, head_dim / 2) that the sliding layers rotate by where a family gives them
        RoPE of their own (Gemma 3's local base), for the positions of ``rope_at``; None (here): every
        layer rotates by ``rope_at``'s tables."""
        return None

    def as_table_dtype(self, tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed tables in the dtype of the model's own (float32, or the model's when it was cast)."""
        return tables[0].to(self.rope_cos.dtype), tables[1].to(self.rope_cos.dtype)

    def forward(self, tokens: torch.Tensor, head_at: torch.Tensor | None = None, mtp: MTPTargets | None = None,
                **kwargs) -> torch.Tensor:
        """Logits (B, T, vocab_size); hidden states on a pipeline stage without the head.
        ``head_at`` (B, T) boolean: the logits (N, vocab_size) of its N true positions only, in
        row-major order, so a loss that reads a few positions (RL's response tokens) spends the
        head's matmul, and whatever reads the logits, on those alone. ``mtp``: in training, with
        ``model.mtp`` modules, each depth's summed loss on these targets is recorded on ``self.mtp``
        (``lmforge.model.mtp``; the step runner adds it); otherwise ignored."""
        hidden = self.hidden_states(tokens, **kwargs)
        if self.lm_head is None:
            return hidden
        if mtp is not None and self.mtp is not None and self.training and torch.is_grad_enabled():
            self.record_mtp_losses(hidden, mtp, kwargs.get("positions"), kwargs.get("attn_mask"))
        return self.logits(hidden if head_at is None else hidden[head_at])

    def record_mtp_losses(self, hidden: torch.Tensor, targets: MTPTargets, positions: torch.Tensor | None,
                          attn_mask: torch.Tensor | None) -> None:
        """Run the MTP depths over the positions each has a target for (depth k: the first L - k - 1 of the
        L tokens of ``targets``) and record their summed losses (``mtp.multi_token_loss``) on ``self.mtp``."""
        logits, labels = [], []
        previous = hidden
        for depth in range(1, len(self.mtp) + 1):
            n = targets.tokens.shape[1] - depth - 1
            mask = attn_mask[..., :n, :n] if attn_mask is not None else None
            previous = self.mtp_hidden(depth, previous[:, :n], targets.tokens[:, depth : depth + n],
                                       positions[:, :n] if positions is not None else None, mask)
            logits.append(self.mtp_logits(depth, previous))
            labels.append(depth_targets(targets, depth))
        self.mtp.losses = multi_token_loss(logits, labels)

    def tp_plan(self, block: nn.Module) -> dict[str, str]:
        """How tensor parallelism splits one of this model's blocks (``distributed.parallelize.apply_tp``):
        module name -> ``colwise`` (split by output features: heads, MLP width), ``rowwise`` (split by
        input features, the output reduced back to the residual stream), and, under sequence
        parallelism only, ``norm`` (runs on its sequence shard), ``output_norm`` (a norm of a branch's
        output before the residual add, as Gemma's: on its sequence shard too, its output the local
        shard the residual stream holds), ``attention`` / ``mlp`` (a branch whose residual-stream input
        is gathered first)."""
        plan = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
                "mlp.w1": "colwise", "mlp.w2": "rowwise", "attn_norm": "norm", "mlp_norm": "norm",
                "attn": "attention", "mlp": "mlp"}
        if block.mlp.w3 is not None:
            plan["mlp.w3"] = "colwise"
        return plan

    def keep_layers(self, layers: range, embed: bool, head: bool) -> Transformer:
        """Make this model a pipeline stage, in place: keep blocks ``layers`` (under their indices,
        so parameter names, ``layers.<i>...``, stay the whole model's) and the embedding only with
        ``embed``, the final norm and LM head only with ``head``; drop the rest. Returns ``self``."""
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in layers})
        if not embed:
            self.embed = self.pos_embed = None
        if not head:
            self.norm = self.lm_head = None
        self.mtp = None  # pipeline parallelism trains without multi-token prediction (refused with model.mtp.depth)
        return self
