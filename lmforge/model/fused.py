"""A decoding layout of a built ``Transformer``: the same module tree with joined projections.

Decoding pushes a few rows through ~40 small matmuls per token, so its time goes to reading
the weights and to per-operator overhead. ``fused_copy`` returns a copy of the module tree
that shares every parameter with the model except the projections it joins: each block's
wq, wk, wv become one ``wqkv`` and SwiGLU's w1, w3 one ``w13`` (``Attention.project_qkv`` and
``MLP.forward`` call them), and with ``pack`` every projection and the LM head hold their
matrix in oneDNN's blocked layout (``PackedLinear``), whose few-row products are faster than
``F.linear``'s on the CPUs measured (``benchmarks/generate.py``; the figures per CPU are in
``benchmarks/results/``). The copy runs ``Transformer.forward`` like
the model: there is no second forward, only other modules in the same places. The model
itself is untouched, so checkpoints, HF export and LoRA target names keep
``wq``/``wk``/``wv``/``w1``/``w3``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from lmforge.model.families import family_of
from lmforge.model.transformer import MLP, Attention, Transformer, rotation_pair_order


class PackedLinear(nn.Module):
    """``nn.Linear`` with its matrix in oneDNN's blocked layout: ``x @ weight.T + bias`` through
    ``torch.ops.mkldnn._linear_pointwise``, the kernel and layout PyTorch's own CPU freezing pass
    (inductor's ``mkldnn_fusion``) gives constant weights. The arithmetic is ``F.linear``'s
    (float32 products and sums for float32; 16-bit products with float32 sums, rounded once,
    for 16-bit); only the order of the sums differs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        # oneDNN picks the blocked layout for a product of PACK_ROWS rows (one row keeps the
        # plain layout); any two or more gave the same layout and speed at 1 to 256 rows.
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")


PACK_ROWS = 8


def joined_linear(linears: Sequence[nn.Linear], pack: bool, order: torch.Tensor | None = None) -> nn.Module:
    """One projection computing ``torch.cat([m(x) for m in linears], -1)[..., order]`` from copies of their weights."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
        if order is not None:
            weight, bias = weight[order], bias[order] if bias is not None else None
    if pack:
        return PackedLinear(weight, bias)
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
    if not family_of(model).decoding_layout:
        return False
    projections = [model.lm_head, *(m.proj for m in (model.mtp or ()))]
    for block in model.blocks():
        projections += [block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo]
        if isinstance(block.mlp, MLP):  # a routed FFN (model.moe) keeps its experts as they are
            projections += [block.mlp.w1, block.mlp.w2] + ([block.mlp.w3] if block.mlp.w3 is not None else [])
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


def fused_copy(model: Transformer, pack: bool) -> Transformer:
    """The decoding layout of a plain model (``is_plain``): joined q/k/v and w1/w3, and with
    ``pack`` every projection and the head as a ``PackedLinear``. Costs the memory of the
    copied matrices."""
    if not is_plain(model):
        raise ValueError("only a plain Transformer (no adapters, quantised or sharded weights) can be fused")
    fused = structural_copy(model).eval()
    fused.rope_pairs = True
    for block in fused.blocks():  # the MTP modules' too: every block rotates by the same pair-order tables
        attn, mlp = block.attn, block.mlp
        attn.wqkv = joined_linear([attn.wq, attn.wk, attn.wv], pack, qkv_pair_order(attn))
        attn.wq = attn.wk = attn.wv = None
        if attn.q_norm is not None:
            attn.q_norm, attn.k_norm = in_pair_order(attn.q_norm), in_pair_order(attn.k_norm)
        if not isinstance(mlp, MLP):  # a routed FFN: its router and stacked experts stay as they are
            if pack:
                attn.wo = joined_linear([attn.wo], pack)
            continue
        if mlp.gated:
            mlp.w13 = joined_linear([mlp.w1, mlp.w3], pack)
            mlp.w1 = mlp.w3 = None
        elif pack:
            mlp.w1 = joined_linear([mlp.w1], pack)
        if pack:
            attn.wo, mlp.w2 = joined_linear([attn.wo], pack), joined_linear([mlp.w2], pack)
    if pack:
        fused.lm_head = joined_linear([fused.lm_head], pack)
        for module in fused.mtp or ():  # the MTP modules' projections (drafting)
            module.proj = joined_linear([module.proj], pack)
    return fused


def qkv_pair_order(attn: Attention) -> torch.Tensor:
    """The rows of the joined q/k/v matrix with q's and k's heads in rotation-pair order
    (``rotation_pair_order``), v's as they are: RoPE then rotates q and k in one complex
    multiply each (``apply_rope``). Queries and keys are permuted alike, so every dot product
    q·k has the same terms; the cache holds keys in this order, which only attention reads."""
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    v = torch.arange((H + Hkv) * D, (H + 2 * Hkv) * D)
    return torch.cat((rotation_pair_order(D, H), H * D + rotation_pair_order(D, Hkv), v))


def in_pair_order(norm: nn.RMSNorm) -> nn.RMSNorm:
    """A QK-norm over heads in rotation-pair order: the same mean of squares, its gains permuted."""
    permuted = nn.RMSNorm(norm.normalized_shape, eps=norm.eps, device="meta")
    permuted.weight = nn.Parameter(norm.weight.detach()[rotation_pair_order(norm.weight.shape[0], 1)], requires_grad=False)
    return permuted


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the decoding copy packs its matrices for oneDNN (``PackedLinear``): on a CPU whose
    oneDNN has kernels for ``dtype`` (float32 always; bf16 and fp16 where the CPU has the
    instructions oneDNN asks for, as ``F.linear`` checks before it calls oneDNN itself)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False
