"""Rotary position embeddings and the ways to stretch them past the pretraining context.

RoPE (Su et al. 2021) turns pair i of each query and key head by the angle p·f_i at
position p, with f_i = theta^(-2i/d) for head dimension d. A scaling type changes the
frequencies f_i, and some also scale cos and sin by an attention factor; each is one
function below, ``ROPE_FREQUENCIES`` maps ``ModelConfig.rope_scaling`` to it. Each returns
``(inv_freq, attention_factor)`` with transformers' arithmetic (``ROPE_INIT_FUNCTIONS`` in
``transformers.modeling_rope_utils``), so the tables equal its float32 values.

Two types depend on the length of the sequence being computed (``LENGTH_DEPENDENT``): dynamic
NTK and LongRoPE use the model's own frequencies up to ``rope_original_max_seq_len`` and
others past it, chosen per forward from each row's longest position (``tables_at``), for a
training forward and for every cached decoding step alike, as transformers'
``dynamic_rope_update`` does. The others are fixed tables built once (``rope_tables``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lmforge.model.config import ModelConfig

SeqLen = int | torch.Tensor | None  # the length a frequency set is for: None (up to the original), or per row (B,)


def plain_inv_freq(theta: float | torch.Tensor, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """f_i = theta^(-2i/d), i = 0 .. d/2 - 1 (Su et al. 2021); ``theta`` may be a
    (B, 1) tensor of one base per row, giving (B, d/2)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))


def default_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """Plain RoPE: f_i = theta^(-2i/d), no attention factor."""
    return plain_inv_freq(cfg.rope_theta, cfg.head_dim, device), 1.0


def linear_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al. 2023): position p is read as p / s, the same as
    f_i' = f_i / s with s = ``rope_factor``, so s times the context maps into the trained range."""
    return plain_inv_freq(cfg.rope_theta, cfg.head_dim, device) / cfg.rope_factor, 1.0


def dynamic_ntk_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """Dynamic NTK-aware scaling (bloc97 and emozilla 2023; "Dynamic NTK" in Peng et al. 2023):
    for a sequence of T tokens the base grows with T past the original context L::

        theta' = theta · (s · max(T, L) / L - (s - 1))^(d / (d - 2)),   f_i' = theta'^(-2i/d)

    (s = ``rope_factor``), so up to L the frequencies are the model's own, and past it the
    lowest ones stretch to cover T while the highest barely move. ``seq_len`` None is a
    sequence within L; a (B,) tensor gives each row's set (B, d/2). As in transformers, the
    base at L is computed in Python floats and a longer one in float32 tensors.
    """
    theta, s, L, d = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_seq_len, cfg.head_dim
    original = plain_inv_freq(theta * ((s * L / L) - (s - 1)) ** (d / (d - 2)), d, device)
    if seq_len is None or (not isinstance(seq_len, torch.Tensor) and seq_len <= L):
        return original, 1.0
    T = torch.as_tensor(seq_len, device=device)
    grown_theta = theta * ((s * torch.clamp(T, min=L) / L) - (s - 1)) ** (d / (d - 2))
    grown = plain_inv_freq(grown_theta[..., None], d, device)
    return torch.where((T > L)[..., None], grown, original), 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's attention temperature (Peng et al. 2023): sqrt(1/t) = 0.1 ln s + 1, unless
    ``rope_attention_factor`` sets it; with ``rope_mscale`` and ``rope_mscale_all_dim``
    (DeepSeek's spelling) the ratio (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)."""
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
    return mscale(cfg.rope_factor)


def yarn_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """YaRN: "NTK-by-parts" interpolation and an attention temperature (Peng et al. 2023). Pair i turns
    r_i = L / λ_i times over the original context L (λ_i = 2π / f_i). Pairs that turn more than
    β = ``rope_beta_fast`` times keep f_i, pairs that turn fewer than α = ``rope_beta_slow``
    times are interpolated to f_i / s, and a linear ramp γ joins them::

        f_i' = (1 - γ_i) f_i / s + γ_i f_i

    The ramp runs over pair indices between the dimensions where r = β and r = α,
    d ln(L / (2π r)) / (2 ln theta), rounded outwards to whole pairs with ``rope_truncate``
    (transformers' ``find_correction_range``). cos and sin are scaled by the attention factor
    (``yarn_attention_factor``): q·k grows by its square, the paper's 1/t.
    """
    theta, s, L, d = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_seq_len, cfg.head_dim

    def dimension_of(rotations: float) -> float:
        return (d * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension_of(cfg.rope_beta_fast), dimension_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # γ: 1 for the fast pairs (kept), 0 for the slow ones (interpolated)
    pos_freqs = theta ** (torch.arange(0, d, 2, device=device).float() / d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep, yarn_attention_factor(cfg)


def longrope_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024; Phi-3's scaling): each pair's frequency is divided by
    its own searched factor, f_i' = f_i / λ_i, with λ = ``rope_short_factor`` for a sequence within
    the original context L and ``rope_long_factor`` past it. cos and sin are scaled by
    sqrt(1 + ln s / ln L) for s = ``rope_factor`` > 1 (1 otherwise), unless
    ``rope_attention_factor`` sets it. A (B,) ``seq_len`` chooses the set per row (B, d/2).
    """
    L = cfg.rope_original_max_seq_len
    attention = cfg.rope_attention_factor
    if attention is None:
        attention = 1.0 if cfg.rope_factor <= 1.0 else math.sqrt(1 + math.log(cfg.rope_factor) / math.log(L))
    shape = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim

    def divided(factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * cfg.rope_theta**shape)

    short = divided(cfg.rope_short_factor)
    if seq_len is None or (not isinstance(seq_len, torch.Tensor) and seq_len <= L):
        return short, attention
    long = divided(cfg.rope_long_factor)
    if not isinstance(seq_len, torch.Tensor):
        return long, attention
    return torch.where((seq_len > L)[..., None], long, short), attention


def llama3_frequencies(cfg: ModelConfig, device: torch.device | None = None, seq_len: SeqLen = None) -> tuple[torch.Tensor, float]:
    """RoPE frequencies stretched for a longer context, as in Meta's Llama 3.1 release
    (``apply_scaling`` in meta-llama/llama-models; transformers' ``_compute_llama3_parameters``).

    With wavelength λ = 2π / f, L = ``rope_original_max_seq_len``, λ_lo = L / low_freq_factor and
    λ_hi = L / high_freq_factor (λ_hi < λ_lo), s = ``rope_factor``::

        f' = f / s                    if λ > λ_lo   (long wavelengths: interpolated)
        f' = f                        if λ < λ_hi   (short wavelengths: kept)
        f' = (1 - k) f / s + k f      otherwise, k = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor)

    The operations follow transformers' order, so the tables match its float32 values.
    """
    inv_freq = plain_inv_freq(cfg.rope_theta, cfg.head_dim, device)
    factor, low, high, L = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > L / low, inv_freq / factor, inv_freq)
    smooth = (L / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= L / high) & (wavelen <= L / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


ROPE_FREQUENCIES: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    "none": default_frequencies,
    "linear": linear_frequencies,
    "dynamic": dynamic_ntk_frequencies,
    "yarn": yarn_frequencies,
    "longrope": longrope_frequencies,
    "llama3": llama3_frequencies,
}
LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})  # frequencies chosen per forward past rope_original_max_seq_len


def angle_tables(inv_freq: torch.Tensor, attention: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attention · cos and attention · sin of p·f_i for positions (..., T) and frequencies (d/2,)
    or one set per row (B, d/2): shape (..., T, d/2), float32."""
    freqs = inv_freq if inv_freq.ndim == 1 else inv_freq[:, None, :]
    angles = positions[..., None].float() * freqs
    cos, sin = angles.cos(), angles.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin


def rope_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim / 2), in float32 (Su et al. 2021, eq. 34), with
    ``cfg.rope_scaling``'s frequencies and attention factor; for a length-dependent type, those
    of a sequence within ``rope_original_max_seq_len`` (``tables_at`` computes longer ones)."""
    inv_freq, attention = ROPE_FREQUENCIES[cfg.rope_scaling](cfg, device)
    return angle_tables(inv_freq, attention, torch.arange(cfg.max_seq_len, device=device))


def tables_at(cfg: ModelConfig, positions: torch.Tensor, seq_len: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B or 1, T, head_dim / 2) of ``positions`` (B or 1, T) with the frequencies of a
    sequence of ``seq_len`` tokens, one for all rows or (B,) one per row (a length-dependent type)."""
    inv_freq, attention = ROPE_FREQUENCIES[cfg.rope_scaling](cfg, positions.device, seq_len=seq_len)
    return angle_tables(inv_freq, attention, positions)
