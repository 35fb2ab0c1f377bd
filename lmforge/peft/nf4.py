"""NF4 (4-bit NormalFloat) frozen base weights for QLoRA (Dettmers et al. 2023, arXiv:2305.14314).

A weight is cut into blocks of ``block_size`` consecutive elements (row-major). Each block b is
scaled by its absolute maximum s_b and every element is stored as the index of the nearest
NF4 code:

    q_i = argmin_k |w_i / s_b - c_k|,        w_i ≈ c_{q_i} · ŝ_b

Double quantisation stores the block scales themselves in 8 bits: with m = mean_b(s_b), the
centred scales (s_b - m) are grouped in blocks of ``scaler_block_size`` and each group g keeps
one factor f_g = 256 / (2 · max|s_b - m|):

    ŝ_b = round(clamp((s_b - m) · f_g)) / f_g + m,        int8 per block, one f_g per group.

This is a pure-PyTorch copy of torchao's ``to_nf4`` scheme (torchao 0.18,
``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py``), op for op, so that tests can
compare against it bit for bit. It is *not* bit-identical to bitsandbytes: torchao's codebook is
rounded to 4 decimals, bnb's nested quantisation uses its dynamic 8-bit map. ``peft.quant``'s
``QuantizedLinear`` holds these tensors under a LoRA adapter (``NF4Format``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# torchao 0.18 `NF4Tensor.from_tensor` codebook, rounded to 4 decimals. The paper's values
# (QLoRA appendix E; bitsandbytes `get_4bit_type("nf4")`) are NF4_CODEBOOK_PAPER below; we use
# torchao's so our quantiser can be tested for exact equality against it.
NF4_CODEBOOK: tuple[float, ...] = (
    -1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000,
)  # fmt: skip
NF4_CODEBOOK_PAPER: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

# Elements per nearest-code search; bounds the (chunk, 16) distance matrix (torchao uses 1024**2).
_CHUNK = 1024**2


@dataclass(frozen=True)
class NF4Weight:
    """A weight in NF4 with double-quantised block scales (the tensors torchao's ``NF4Tensor`` holds)."""

    packed: torch.Tensor  # uint8 (numel/2,): two codes per byte, the first element in the high nibble
    quantized_scalers: torch.Tensor  # int8 (numel/block_size,): centred block absmax · factor
    quantization_factor: torch.Tensor  # (n_blocks/scaler_block_size,) in `dtype`: 256 / (2·absmax)
    scaler_mean: torch.Tensor  # 0-d in `dtype`: mean of the block absmaxes, added back on dequantise
    shape: torch.Size
    dtype: torch.dtype
    block_size: int
    scaler_block_size: int

    def nbytes(self) -> int:
        """Bytes of storage: numel/2 + numel/block_size + factors + mean (shape/dtype metadata aside)."""
        tensors = (self.packed, self.quantized_scalers, self.quantization_factor, self.scaler_mean)
        return sum(t.numel() * t.element_size() for t in tensors)


def check_nf4_shape(shape: torch.Size, block_size: int, scaler_block_size: int) -> None:
    numel = shape.numel()
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"NF4 block_size must be a positive even number (two codes per byte), got {block_size}")
    if scaler_block_size <= 0:
        raise ValueError(f"NF4 scaler_block_size must be positive, got {scaler_block_size}")
    if numel == 0 or numel % block_size:
        raise ValueError(
            f"cannot quantise a weight of shape {tuple(shape)} ({numel} elements) to NF4 with "
            f"block_size={block_size}: the element count must be a non-zero multiple of the block size; "
            f"choose a block_size that divides {numel} or leave this layer unquantised"
        )
    n_blocks = numel // block_size
    if n_blocks % scaler_block_size:
        raise ValueError(
            f"cannot double-quantise the scales of a weight of shape {tuple(shape)} ({numel} elements): "
            f"its {n_blocks} blocks of block_size={block_size} do not divide into scaler blocks of "
            f"scaler_block_size={scaler_block_size}; the element count must be a multiple of "
            f"block_size*scaler_block_size={block_size * scaler_block_size}"
        )


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256) -> NF4Weight:
    """Quantise ``weight`` to NF4 with double-quantised scales, exactly as torchao's ``to_nf4``.

    Arithmetic happens in the weight's dtype (so a bf16 weight uses a bf16-rounded codebook, as
    in torchao). One deliberate difference: an all-zero block, where torchao divides 0 by 0 and
    stores an arbitrary code, gets the code for 0.0 and dequantises to exact zeros.
    """
    if not weight.is_floating_point():
        raise TypeError(f"quantize_nf4 expects a floating-point weight, got dtype {weight.dtype}")
    check_nf4_shape(weight.shape, block_size, scaler_block_size)
    flat = weight.detach().reshape(-1)
    n_blocks = flat.numel() // block_size
    n_scaler_blocks = n_blocks // scaler_block_size

    blocks = flat.view(n_blocks, block_size)
    absmax = blocks.abs().amax(dim=1)

    # Double quantisation of the block scales (torchao `double_quantize_scalers`).
    scaler_mean = absmax.mean()
    scaler_blocks = (absmax - scaler_mean).view(n_scaler_blocks, scaler_block_size)
    factor = 256 / (2 * scaler_blocks.abs().amax(dim=1, keepdim=True))
    quantized_scalers = (scaler_blocks * factor).round().clamp(-128, 127).flatten().to(torch.int8)

    # Nearest code of each element scaled by its block's *unquantised* absmax (as torchao does).
    scaled = (blocks / absmax.unsqueeze(-1)).flatten()
    scaled = torch.where(scaled.isnan(), 0.0, scaled)  # 0/0 in an all-zero block
    codebook = torch.tensor(NF4_CODEBOOK, dtype=weight.dtype, device=weight.device)
    codes = torch.empty(scaled.numel(), dtype=torch.uint8, device=weight.device)
    for start in range(0, scaled.numel(), _CHUNK):
        chunk = scaled[start : start + _CHUNK].unsqueeze(-1)
        codes[start : start + _CHUNK] = (chunk - codebook).abs().min(dim=-1).indices.to(torch.uint8)

    return NF4Weight(
        packed=codes[::2] << 4 | codes[1::2],
        quantized_scalers=quantized_scalers,
        quantization_factor=factor.view(n_scaler_blocks).contiguous(),
        scaler_mean=scaler_mean,
        shape=weight.shape,
        dtype=weight.dtype,
        block_size=block_size,
        scaler_block_size=scaler_block_size,
    )


def dequantize_nf4(q: NF4Weight) -> torch.Tensor:
    """Rebuild the weight, w_i = c_{q_i} · ŝ_b, in ``q.dtype`` (equal to torchao's ``get_original_weight``)."""
    n_blocks = q.quantized_scalers.numel()
    codes = torch.stack((q.packed >> 4, q.packed & 0b1111), dim=-1).flatten().long()
    codebook = torch.tensor(NF4_CODEBOOK, dtype=q.dtype, device=q.packed.device)
    scalers = q.quantized_scalers.view(-1, q.scaler_block_size) / q.quantization_factor.unsqueeze(-1)
    scalers = scalers.flatten().to(q.dtype) + q.scaler_mean
    return (codebook[codes].view(n_blocks, q.block_size) * scalers.unsqueeze(-1)).view(q.shape)
