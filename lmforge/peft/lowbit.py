"""2-, 3- and 4-bit integer frozen base weights by HQQ (half-quadratic quantisation, Badri & Shaji 2023).

A weight of shape (out, in) is cut into groups of ``group_size`` consecutive elements of a row
(HQQ's ``axis=1``). Group g keeps a scale s_g and a zero point z_g, and each element the integer

    q_i = clamp(round(w_i / s_g + z_g), 0, 2^b − 1),        w_i ≈ (q_i − z_g) · s_g.

The initial s_g, z_g are the min-max ones; HQQ then improves z_g without calibration data by
minimising ‖W − dequant(quant(W))‖_p^p (p = 0.7) with a half-quadratic split: an auxiliary error
W_e is introduced and the two sub-problems alternate (``optimize_weights_proximal_legacy``):

    W_e ← shrink_p(W − W_r, β),     shrink_p(x, β) = sign(x) · relu(|x| − |x|^(p−1) / β)
    z   ← mean_g(W_q − (W − W_e) / s)

for at most 20 iterations while the mean absolute error falls (β = 10, held fixed). HQQ's
``BaseQuantizeConfig`` also rounds the initial zero point for 4 bits; we do the same.

The codes are packed as ``hqq.core.bitpack.BitPack`` packs them: the (n_groups, group_size)
matrix of codes is split along its rows into ``per_word`` slices that share a word, the first
slice in the high bits (4 bits: two per uint8; 2 bits: four per uint8; 3 bits: ten per int32,
the rows padded to a multiple of ten). This module is a pure-PyTorch copy of hqq 0.2.8's
``Quantizer.quantize``/``dequantize`` on CPU, op for op, so ``tests/peft/test_lowbit.py`` can
compare codes, scales and zeros with hqq's own bit for bit. Arithmetic is in float32 (as hqq's on
CPU); the scales and zeros are stored in the weight's dtype, so a bf16 base keeps bf16 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 3, 2)
# bits -> (codes per word, word dtype), hqq's `Quantizer.bit_to_packing` for these widths
PACKING: dict[int, tuple[int, torch.dtype]] = {4: (2, torch.uint8), 3: (10, torch.int32), 2: (4, torch.uint8)}
# hqq `optimize_weights_proximal_legacy`'s defaults
LP_NORM, BETA, ITERS = 0.7, 10.0, 20


def check_lowbit_shape(shape: torch.Size, bits: int, group_size: int) -> None:
    """ValueError unless a (out, in) weight splits into groups of ``group_size`` along its rows."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit integers are not a width of this quantiser; choose one of {', '.join(map(str, BITS))}")
    if len(shape) != 2:
        raise ValueError(f"a low-bit base needs a 2-D (out_features, in_features) weight, got shape {tuple(shape)}")
    if group_size <= 0 or shape[1] % group_size:
        raise ValueError(f"group_size={group_size} does not divide the weight's width (in_features) {shape[1]}: "
                         f"each group of a row needs its own scale and zero point")


def _shrink(x: torch.Tensor, beta: float) -> torch.Tensor:
    """shrink_p(x, β) = sign(x) · relu(|x| − |x|^(p−1)/β), hqq's ``shrink_lp_op`` for p < 1."""
    out = torch.abs(x)
    out.sub_((1.0 / beta) * out.pow(LP_NORM - 1)).clamp_min_(0.0)
    out.mul_(torch.sign(x))
    return out


def _optimize_zero(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's half-quadratic solver of the zero points (``scale`` is the inverse scale 1/s); returns codes and zeros."""
    best = torch.tensor(torch.inf)
    for _ in range(ITERS):
        w_q = torch.round(w * scale + zero).clamp_(0, top)
        w_r = (w_q - zero) / scale
        w_e = _shrink(w - w_r, BETA)
        zero = torch.mean(w_q - (w - w_e) * scale, axis=1, keepdim=True)
        error = torch.abs(w - w_r).mean().float()
        if error < best:
            best = error
        else:
            break  # as hqq: the zero updated in this last step is the one kept
    return torch.round(w * scale + zero).clamp_(0, top), zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n_groups, group_size) codes -> words: ``per_word`` row slices, the first in the high bits (hqq ``BitPack``)."""
    per_word, dtype = PACKING[bits]
    rows = -(-codes.shape[0] // per_word) * per_word
    padded = torch.zeros(rows, codes.shape[1], dtype=dtype, device=codes.device)
    padded[: codes.shape[0]] = codes.to(dtype)
    step = rows // per_word
    packed = torch.zeros(step, codes.shape[1], dtype=dtype, device=codes.device)
    for i in range(per_word):
        packed |= padded[i * step : (i + 1) * step] << (bits * (per_word - 1 - i))
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, n_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``pack_codes``: the first ``n_groups`` rows of codes, in ``dtype``."""
    per_word, _ = PACKING[bits]
    mask = (1 << bits) - 1
    slices = [(packed >> (bits * (per_word - 1 - i))) & mask for i in range(per_word)]
    return torch.cat(slices)[:n_groups].to(dtype)


@dataclass(frozen=True)
class LowBitWeight:
    """A weight in ``bits``-bit integers with a scale and zero point per group (the tensors HQQLinear holds)."""

    packed: torch.Tensor  # uint8 (4, 2 bits) or int32 (3 bits): codes packed as hqq's BitPack
    scale: torch.Tensor  # (n_groups, 1) in `dtype`: s_g
    zero: torch.Tensor  # (n_groups, 1) in `dtype`: z_g, in code units
    shape: torch.Size
    bits: int
    group_size: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


@torch.no_grad()
def quantize_lowbit(weight: torch.Tensor, bits: int, group_size: int = 64) -> LowBitWeight:
    """Quantise ``weight`` to ``bits``-bit integers per group with HQQ's optimised zero points (hqq's
    ``Quantizer.quantize`` with ``BaseQuantizeConfig(nbits=bits, group_size=group_size)``, axis 1)."""
    if not weight.is_floating_point():
        raise TypeError(f"quantize_lowbit expects a floating-point weight, got dtype {weight.dtype}")
    check_lowbit_shape(weight.shape, bits, group_size)
    w = weight.detach().float().reshape(-1, group_size)
    top = 2**bits - 1
    low, high = w.min(axis=1, keepdim=True)[0], w.max(axis=1, keepdim=True)[0]
    denom = high - low
    scale = top / denom  # hqq works with the inverse scale and inverts it at the end
    scale = torch.where(denom.abs() <= 1e-4, torch.full_like(scale, 1.0), scale).clamp(max=2e4)
    zero = -low * scale
    if bits == 4:
        zero = torch.round(zero)
    codes, zero = _optimize_zero(w, scale, zero, top)
    return LowBitWeight(pack_codes(codes, bits), (1.0 / scale).to(weight.dtype), zero.to(weight.dtype),
                        weight.shape, bits, group_size)


def dequantize_lowbit(q: LowBitWeight) -> torch.Tensor:
    """w = (q − z_g) · s_g in the scales' dtype (hqq's ``Quantizer.dequantize``)."""
    n_groups = q.shape.numel() // q.group_size
    codes = unpack_codes(q.packed, q.bits, n_groups, q.scale.dtype)
    return ((codes - q.zero) * q.scale).reshape(q.shape)
