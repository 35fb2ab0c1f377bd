"""Text generation with a KV cache: prefill the prompts once, then decode one token per step.

Prompts of different lengths share a batch by left padding: each row's RoPE positions
start at 0 at its first real token and an attention mask hides the padding, so every row
computes what it would alone. A batch with no padding takes the plain path (no mask, no
position tables), and the cache is allocated once for prompt + ``max_new_tokens``.

``generate`` runs the model's arithmetic over a ``FusedTransformer``: the same weights laid
out for decoding (one matmul for q, k, v and one for SwiGLU's w1, w3, matrices stored
transposed), built on the first call and reused while the parameters are unchanged.

    results = generate(model, [[bos, *tok.encode("Once upon")]], GenerationConfig(temperature=0), tok)
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.core.config import at_least, positive, seed_field, unit_interval
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.transformer import (
    KVCache,
    Transformer,
    cached_prefix_mask,
    check_length,
    positions_and_mask,
    slow_16bit_kernels,
)

FinishReason = Literal["stop", "length"]


# --------------------------------------------------------------------------- sampling


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018): logits outside the k largest of each row become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of tokens whose probability sums to >= p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it, so it stays
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): greedy argmax at temperature 0, else softmax(logits / T) sampling after top-k and top-p."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


# --------------------------------------------------------------------------- the model laid out for decoding


def decoding_matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the decoding view's matrices for a model in ``dtype``: float32 for a 16-bit
    model on a CPU without AMX, else ``dtype``.

    Without AMX tiles a CPU's bf16/fp16 matmuls at decoding's few rows ran 1.3-4x slower than
    float32's (oneDNN's avx512_core_bf16 kernels, 2026-11-30), so there the view keeps the 16-bit
    weights upcast (exactly) to float32 and ``linear_t`` rounds each product back to the model's
    dtype: the arithmetic of a 16-bit matmul with float32 accumulation, at float32's speed, for
    twice the view's memory.
    """
    return torch.float32 if slow_16bit_kernels(dtype, device.type) else dtype


def linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with the weight stored transposed, (in, out); a float32 weight with 16-bit
    ``x`` computes in float32 and rounds the result to ``x``'s dtype (``decoding_matmul_dtype``)."""
    if x.dtype != weight_t.dtype:
        y = x.to(weight_t.dtype) @ weight_t
        return (y if bias is None else y.add_(bias)).to(x.dtype)
    y = x @ weight_t
    return y if bias is None else y + bias


def residual_linear(x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x + h @ weight_t (+ bias)`` for 2-D ``x`` and ``h``: the add rides on the matmul (BLAS's beta = 1).
    Dtypes as ``linear_t``."""
    if x.dtype != weight_t.dtype:
        y = torch.addmm(x.to(weight_t.dtype), h.to(weight_t.dtype), weight_t)
        return (y if bias is None else y.add_(bias)).to(x.dtype)
    y = torch.addmm(x, h, weight_t)
    return y if bias is None else y.add_(bias)


@dataclass
class FusedBlock:
    """One ``Block``'s weights for decoding: matrices transposed to (in, out), each norm's gain
    folded into the matrix that reads it, and q/k columns in rotation-pair order."""

    wqkv: torch.Tensor  # (d_model, (n_heads + 2 n_kv_heads) head_dim): wq, wk, wv side by side
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None  # QK-norm gains, in rotation-pair order
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    w13: torch.Tensor  # (d_model, 2 ffn_hidden): w1 and w3 side by side (w1 alone for GELU)
    b13: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None


def rotation_pair_order(head_dim: int, n_heads: int) -> torch.Tensor:
    """Column order that puts RoPE's pairs (i, i + head_dim/2) of each head side by side, so a
    head's vector reads as head_dim/2 complex numbers and the rotation is one complex multiply.
    Queries and keys get the same order, so every dot product q·k is unchanged."""
    half = torch.arange(head_dim // 2)
    pairs = torch.stack((half, half + head_dim // 2), dim=-1).flatten()
    return (torch.arange(n_heads)[:, None] * head_dim + pairs).flatten()


def fold(linears: Sequence[nn.Linear], dtype: torch.dtype, norm: nn.Module | None = None, gain_scale: float = 1.0,
         columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (in, sum of outs) matrix in ``dtype`` for linears that read the same input, and their joint bias.

    With ``norm``, its affine part moves into the matrix: ``(n(x) * g + b) @ W + c`` is
    ``n(x) @ (g W) + (b @ W + c)``, so decoding applies only the norm's normalisation.
    ``columns`` reorders the outputs.
    """
    weight = torch.cat([m.weight for m in linears]).t().to(dtype)
    bias = torch.cat([m.bias for m in linears]).to(dtype) if linears[0].bias is not None else None
    if norm is not None:
        norm_bias = getattr(norm, "bias", None)
        if norm_bias is not None:
            folded = norm_bias.double() @ weight.double()
            bias = (folded if bias is None else folded + bias.double()).to(weight.dtype)
        weight = weight * (norm.weight.double() * gain_scale)[:, None].to(weight.dtype)
    if columns is not None:
        weight, bias = weight[:, columns], bias[columns] if bias is not None else None
    return weight.contiguous(), bias


def rotate_(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """RoPE in place on heads in rotation-pair order: each pair (x[2i], x[2i+1]) is a complex
    number multiplied by the unit ``rotation`` cos θ + i sin θ (float32 arithmetic, as ``apply_rope``)."""
    if x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rotation)
    else:
        x.copy_(torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rotation).flatten(-2))
    return x


class FusedTransformer:
    """``Transformer.hidden_states`` and ``lm_head`` over the same weights laid out for decoding.

    A decode step is a few rows through ~30 small matmuls, so its time goes to reading the
    weights and to the per-operator overhead of everything around them. The layout cuts both:
    one matmul for q, k and v and one for w1 and w3; ``x @ W`` with W stored (in, out), which
    runs up to 2x faster on a CPU than ``F.linear`` at 8 rows; each block norm's gain (and
    LayerNorm's bias) folded into the matrix after it, so RMSNorm is four small operators instead
    of the eight of ``F.rms_norm``; q and k columns reordered so RoPE is one in-place complex
    multiply; the residual stream kept as (tokens, d_model) so each residual add rides on its
    matmul (``addmm``). Queries and keys in the cache are in that reordered layout, which
    attention does not see (it only takes dot products). The arithmetic is the model's up to
    float rounding (``tests/model/test_generate.py``); a 16-bit model on a CPU without AMX keeps
    float32 matrices (``decoding_matmul_dtype``).
    """

    def __init__(self, model: Transformer):
        cfg = self.cfg = model.cfg
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        rms = cfg.norm == "rmsnorm"
        # RMSNorm is computed as x / sqrt(sum(x^2) + d eps), which is sqrt(d) times x / rms(x).
        gain_scale = math.sqrt(cfg.d_model) if rms else 1.0
        self.rms_eps = torch.tensor(cfg.d_model * cfg.norm_eps, dtype=torch.float32, device=model.embed.weight.device)
        order = rotation_pair_order(D, H + Hkv)
        qkv_columns = torch.cat((order, torch.arange((H + Hkv) * D, (H + 2 * Hkv) * D)))
        self.embed = model.embed
        self.rotation = torch.complex(model.rope_cos.float(), model.rope_sin.float())[:, None]  # (max_seq_len, 1, head_dim / 2)
        dtype = decoding_matmul_dtype(model.embed.weight.dtype, model.embed.weight.device)
        self.layers = []
        for block in model.layers:
            attn, mlp = block.attn, block.mlp
            wqkv, bqkv = fold([attn.wq, attn.wk, attn.wv], dtype, block.attn_norm, gain_scale, qkv_columns)
            wo, bo = fold([attn.wo], dtype)
            w13, b13 = fold([mlp.w1, mlp.w3] if mlp.gated else [mlp.w1], dtype, block.mlp_norm, gain_scale)
            w2, b2 = fold([mlp.w2], dtype)
            head_order = order[:D]
            self.layers.append(FusedBlock(
                wqkv=wqkv, bqkv=bqkv,
                q_norm=attn.q_norm.weight[head_order] if attn.q_norm is not None else None,
                k_norm=attn.k_norm.weight[head_order] if attn.k_norm is not None else None,
                wo=wo, bo=bo, w13=w13, b13=b13, w2=w2, b2=b2,
            ))
        self.final_norm = model.norm
        self.head = model.lm_head.weight.t().to(dtype).contiguous()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """A block norm without its affine part (folded into the next matrix); see ``__init__``."""
        if self.cfg.norm != "rmsnorm":
            return F.layer_norm(x, x.shape[-1:], None, None, self.cfg.norm_eps)
        if x.dtype != torch.float32:
            return self.normalize(x.float()).type_as(x)
        return x * torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1) + self.rms_eps)

    def attention(self, layer: int, x: torch.Tensor, B: int, T: int, rotation: torch.Tensor,
                  attn_mask: torch.Tensor | None, kv_cache: KVCache | None) -> torch.Tensor:
        """``x`` plus the attention block's output; ``x`` is (B·T, d_model)."""
        w, cfg = self.layers[layer], self.cfg
        H, Hkv = cfg.n_heads, cfg.n_kv_heads
        heads = linear_t(self.normalize(x), w.wqkv, w.bqkv).view(B, T, H + 2 * Hkv, cfg.head_dim)
        if w.q_norm is not None:
            shape, eps = (cfg.head_dim,), cfg.norm_eps
            heads[:, :, :H] = F.rms_norm(heads[:, :, :H], shape, w.q_norm, eps)
            heads[:, :, H : H + Hkv] = F.rms_norm(heads[:, :, H : H + Hkv], shape, w.k_norm, eps)
        rotate_(heads[:, :, : H + Hkv], rotation)  # one rotation for q and k, in place
        q, k, v = heads.transpose(1, 2).split((H, Hkv, Hkv), dim=1)
        if kv_cache is not None:
            k, v = kv_cache.store(layer, k, v)
        is_causal = attn_mask is None and T > 1
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=Hkv != H)
        return residual_linear(x, y.transpose(1, 2).reshape(B * T, -1), w.wo, w.bo)

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the MLP block's output."""
        w = self.layers[layer]
        h = linear_t(self.normalize(x), w.w13, w.b13)
        if self.cfg.ffn == "swiglu":
            half = h.shape[-1] // 2
            h = F.silu(h[:, :half]) * h[:, half:]
        else:
            h = F.gelu(h, approximate="tanh")
        return residual_linear(x, h, w.w2, w.b2)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """What ``Transformer.hidden_states`` returns, with the same arguments."""
        B, T = tokens.shape
        offset = kv_cache.length if kv_cache is not None else 0
        if positions is None:
            check_length(self.cfg, offset, T)
            rotation = self.rotation[offset : offset + T]  # (T, 1, head_dim / 2)
        else:
            rotation = self.rotation[positions]  # (B, T, 1, head_dim / 2)
        attn_mask = cached_prefix_mask(attn_mask, offset, T, tokens.device)
        x = F.embedding(tokens.view(-1), self.embed.weight)
        for layer in range(len(self.layers)):
            x = self.attention(layer, x, B, T, rotation, attn_mask, kv_cache)
            x = self.mlp(layer, x)
        if kv_cache is not None:
            kv_cache.length += T
        return self.final_norm(x).view(B, T, -1)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_t(hidden, self.head, None)


_fused_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights fingerprint, view)


def can_fuse(model: nn.Module) -> bool:
    """Whether every layer is the plain one ``FusedTransformer`` reads: no adapters, quantised or sharded weights."""
    if not isinstance(getattr(model, "_orig_mod", model), Transformer):
        return False
    for block in model.layers:
        linears = [block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo, block.mlp.w1, block.mlp.w2]
        if block.mlp.w3 is not None:
            linears.append(block.mlp.w3)
        if any(type(m) is not nn.Linear for m in linears):
            return False
    return type(model.lm_head) is nn.Linear and all(type(p) in (nn.Parameter, torch.Tensor) for p in model.parameters())


def decoding_view(model: Transformer) -> Transformer | FusedTransformer:
    """The model's ``FusedTransformer``, rebuilt when a parameter or buffer has changed since the last call
    (moved, cast, loaded or stepped), or the model itself when its layers are not plain (LoRA, NF4, DTensor)."""
    if not can_fuse(model):
        return model
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if any(t.is_inference() for t in tensors):  # inference tensors keep no version counter: rebuild every call
        return FusedTransformer(model)
    fingerprint = [(t.data_ptr(), t._version, t.dtype) for t in tensors]
    cached = _fused_views.get(model)
    if cached is None or cached[0] != fingerprint:
        cached = (fingerprint, FusedTransformer(model))
        _fused_views[model] = cached
    return cached[1]


def release_decoding_view(model: Transformer) -> None:
    """Drop the cached decoding copy of ``model``'s weights: it costs as much memory as the
    weights (twice as much with float32 matrices, ``decoding_matmul_dtype``), so a caller that
    goes back to training the model releases it first."""
    _fused_views.pop(model, None)


# --------------------------------------------------------------------------- prefill and decode


@dataclass
class DecodeState:
    """What decoding a left-padded batch needs between steps."""

    cache: KVCache
    next_positions: torch.Tensor | None  # (B, 1) RoPE position of each row's next token; None when unpadded
    key_mask: torch.Tensor | None  # (B, 1, 1, cache length) True at real tokens; None when unpadded


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one (B, T) tensor padded on the left, and each prompt's length (B,)."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    return tokens.to(device), torch.tensor([len(p) for p in prompts], device=device)


def prefill(model: Transformer | FusedTransformer, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[torch.Tensor, DecodeState]:
    """Run the prompts through the model into a fresh cache; return the last position's logits (B, V) and the state."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (add a BOS token to an empty prompt)")
    param = model.embed.weight
    tokens, lengths = left_pad(prompts, 0, param.device)
    B, T = tokens.shape
    total = T + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"the longest prompt ({T} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len {model.cfg.max_seq_len}; shorten the prompt or lower max_new_tokens"
        )
    cache = KVCache.empty(model.cfg, B, total, param.dtype, param.device)
    if all(len(p) == T for p in prompts):
        hidden = model.hidden_states(tokens, kv_cache=cache)
        state = DecodeState(cache, next_positions=None, key_mask=None)
    else:
        pads = (T - lengths)[:, None]  # (B, 1)
        slots = torch.arange(total, device=param.device)[None]  # (1, total)
        real = slots >= pads  # (B, total): padding slots are False, every slot after the prompt True
        positions, mask = positions_and_mask(real[:, :T])
        hidden = model.hidden_states(tokens, positions=positions, attn_mask=mask, kv_cache=cache)
        state = DecodeState(cache, next_positions=lengths[:, None].clone(), key_mask=real[:, None, None, :])
    return model.lm_head(hidden[:, -1]), state


def decode_step(model: Transformer | FusedTransformer, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Feed one new token per row (B,); return the next logits (B, V)."""
    if state.key_mask is None:
        hidden = model.hidden_states(tokens[:, None], kv_cache=state.cache)
    else:
        end = state.cache.length + 1
        hidden = model.hidden_states(
            tokens[:, None], positions=state.next_positions, attn_mask=state.key_mask[..., :end], kv_cache=state.cache
        )
        state.next_positions += 1
    return model.lm_head(hidden[:, -1])


# --------------------------------------------------------------------------- the loop


@dataclass
class GenerationConfig:
    """How to pick tokens and when to stop."""

    max_new_tokens: int = positive(128)
    temperature: float = at_least(0, 1.0)  # 0 = greedy
    top_k: int = at_least(0, 0)  # 0 = off
    top_p: float = unit_interval(1.0, low_open=True)  # 1 = off
    stop: list[str] = field(default_factory=list)  # the text is cut before the first one found
    stop_token_ids: list[int] | None = at_least(0, None)  # None = the tokenizer's EOS; [] = never stop early
    seed: int | None = seed_field(None)  # None = torch's global generator

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0.0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self.temperature}, {self.top_k}, {self.top_p}"
            )


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest of ``stops`` starts in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


@dataclass
class Generation:
    """One prompt's continuation.

    ``tokens`` excludes a stop token and includes the token that completed a stop string;
    ``text`` (when a tokenizer was given) is cut before the stop string.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: FinishReason
    text: str | None = None


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    tokenizer: Tokenizer | None = None,
) -> list[Generation]:
    """Continue each prompt (token ids) until a stop token, a stop string or ``max_new_tokens``."""
    if config.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the text")
    stop_ids = config.stop_token_ids
    if stop_ids is None:
        stop_ids = [tokenizer.eos_id] if tokenizer is not None else []
    stop_ids = set(stop_ids)
    generator = None
    if config.seed is not None:
        generator = torch.Generator(model.embed.weight.device).manual_seed(config.seed)

    tail_tokens = 4 * max((len(s) for s in config.stop), default=0) + 4
    net = decoding_view(model)
    logits, state = prefill(net, prompts, config.max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    texts: list[str | None] = [None] * len(prompts)
    finished: list[FinishReason | None] = [None] * len(prompts)
    for step in range(config.max_new_tokens):
        next_tokens = sample_next_token(logits, config.temperature, config.top_k, config.top_p, generator)
        for row, token in enumerate(next_tokens.tolist()):
            if finished[row] is not None:
                continue
            if token in stop_ids:
                finished[row] = "stop"
                continue
            outputs[row].append(token)
            # Look for a stop string in the last few tokens only (a token is at least one byte,
            # a character at most four), then cut the whole text at the first one.
            if config.stop and find_stop(tokenizer.decode(outputs[row][-tail_tokens:]), config.stop) >= 0:
                text = tokenizer.decode(outputs[row])
                cut = find_stop(text, config.stop)
                if cut >= 0:
                    texts[row], finished[row] = text[:cut], "stop"
        if all(f is not None for f in finished) or step == config.max_new_tokens - 1:
            break
        logits = decode_step(net, next_tokens, state)

    results = []
    for prompt, tokens, reason, text in zip(prompts, outputs, finished, texts):
        if tokenizer is not None and text is None:
            text = tokenizer.decode(tokens)
        results.append(Generation(list(prompt), tokens, reason or "length", text))
    return results
