"""LoftQ: LoRA adapters initialised from the quantisation residual (Li et al. 2023, arXiv:2310.08659).

Naive QLoRA starts from Q = quant(W) with B = 0, so training begins with all of the quantisation
error W − Q in the model; at 2 or 3 bits that error is large enough to break fine-tuning. LoftQ
chooses Q and the adapter together, alternating for t = 1..T (its Algorithm 1):

    Q_t = quant(W − L_{t−1} R_{t−1}),        L_t R_t = SVD_r(W − Q_t)    (L_0 R_0 = 0)

where SVD_r keeps the r largest singular values, L = U_r √Σ_r and R = √Σ_r V_rᵀ. The base stores
Q_T and the adapter's update s·B A equals L_T R_T, so the model starts at Q_T + L_T R_T ≈ W. This
follows peft's ``loftq_init`` (``peft/utils/loftq_utils.py``: the same loop, the residual not
recomputed after the last SVD), with two differences: any of our formats is the quantiser (peft's
needs bitsandbytes on a GPU), and the LoRA scaling s = α/r is divided out, A = R/√s and B = L/√s
(peft sets A = R, B = L, so its model starts at Q + s·L R, which is ≈ W only when α = r).
"""

from __future__ import annotations

import math

import torch

from lmforge.peft.quant import QuantFormat


@torch.no_grad()
def loftq_init(weight: torch.Tensor, fmt: QuantFormat, r: int, scaling: float, iters: int = 1
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The quantised base Q_T (``fmt``'s tensors) and LoRA's A (r, in) and B (out, r), in ``weight``'s dtype,
    with s·B A = L_T R_T the rank-r SVD of W − dequant(Q_T)."""
    if iters < 1:
        raise ValueError(f"LoftQ needs at least one iteration, got {iters}")
    w = weight.detach().float()
    residual = w
    for _ in range(iters):
        tensors = fmt.quantize(residual.to(weight.dtype))
        u, sigma, vh = torch.linalg.svd(w - fmt.dequantize(tensors, weight.shape).float(), full_matrices=False)
        k = min(r, sigma.numel())
        root = sigma[:k].sqrt()
        left = torch.zeros(w.shape[0], r, dtype=w.dtype, device=w.device)
        right = torch.zeros(r, w.shape[1], dtype=w.dtype, device=w.device)
        left[:, :k], right[:k] = u[:, :k] * root, root[:, None] * vh[:k]
        residual = w - left @ right
    split = math.sqrt(scaling)
    return tensors, (right / split).to(weight.dtype), (left / split).to(weight.dtype)
