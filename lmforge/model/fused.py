"""A decoding layout of a built ``Transformer``: the same module tree with joined projections.

Decoding pushes a few rows through ~40 small matmuls per token, so its time goes to reading
the weights and to per-operator overhead. ``fused_copy`` returns a copy of the module tree
that shares every parameter with the model except the projections it joins: each block's
wq, wk, wv become one ``wqkv`` and SwiGLU's w1, w3 one ``w13`` (``Attention.project_qkv`` and
``MLP.forward`` call them), and with ``transpose`` every projection and the LM head keep
their matrix as (in, out), which a CPU reads faster at one row (``benchmarks/results/generate.json``
records the layouts measured). The copy runs ``Transformer.forward`` like the model: there is
no second forward, only other modules in the same places. The model itself is untouched, so
checkpoints, HF export and LoRA target names keep ``wq``/``wk``/``wv``/``w1``/``w3``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from lmforge.model.transformer import Transformer


class TransposedLinear(nn.Module):
    """``nn.Linear`` with its matrix stored transposed, (in, out): ``x @ weight_t + bias``."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def joined_linear(linears: Sequence[nn.Linear], transpose: bool) -> nn.Module:
    """One projection computing ``torch.cat([m(x) for m in linears], -1)`` from copies of their weights."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    if transpose:
        return TransposedLinear(weight.t().contiguous(), bias)
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        joined.bias = nn.Parameter(bias, requires_grad=False)
    return joined


def is_plain(model: nn.Module) -> bool:
    """Whether the model's projections are plain ``nn.Linear`` modules over plain tensors, the
    only ones whose weights can be joined (a LoRA, NF4 or sharded model decodes as it is)."""
    if not isinstance(model, Transformer) or model.embed is None or model.lm_head is None:
        return False
    projections = [model.lm_head]
    for block in model.layers.children():
        projections += [block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo, block.mlp.w1, block.mlp.w2]
        projections += [block.mlp.w3] if block.mlp.w3 is not None else []
    return all(type(m) is nn.Linear for m in projections) and all(
        type(p) in (nn.Parameter, torch.Tensor) for p in model.parameters())


def structural_copy(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose modules are new objects and whose parameters and buffers
    are the original tensors (no memory), so swapping a submodule leaves the original as it was."""
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = {name: structural_copy(child) if child is not None else None for name, child in module._modules.items()}
    return new


def fused_copy(model: Transformer, transpose: bool) -> Transformer:
    """The decoding layout of a plain model (``is_plain``): joined q/k/v and w1/w3, and with
    ``transpose`` every projection stored (in, out). Costs the memory of the copied matrices."""
    if not is_plain(model):
        raise ValueError("only a plain Transformer (no adapters, quantised or sharded weights) can be fused")
    fused = structural_copy(model).eval()
    for block in fused.layers.children():
        attn, mlp = block.attn, block.mlp
        attn.wqkv = joined_linear([attn.wq, attn.wk, attn.wv], transpose)
        attn.wq = attn.wk = attn.wv = None
        if mlp.gated:
            mlp.w13 = joined_linear([mlp.w1, mlp.w3], transpose)
            mlp.w1 = mlp.w3 = None
        elif transpose:
            mlp.w1 = joined_linear([mlp.w1], transpose)
        if transpose:
            attn.wo, mlp.w2 = joined_linear([attn.wo], transpose), joined_linear([mlp.w2], transpose)
    if transpose:
        fused.lm_head = joined_linear([fused.lm_head], transpose)
    return fused


def linear_reads_transposed_faster(dtype: torch.dtype, device: torch.device) -> bool:
    """The layout the decoding copy takes: (in, out) matrices for float32 on a CPU, where a
    one-row product over them was 1.5-1.8x faster than ``F.linear``'s (out, in) (the matrices
    out of cache); 16-bit CPU products and GPUs were as fast or faster with ``F.linear``."""
    return device.type == "cpu" and dtype == torch.float32

