"""Gradient-norm clipping over parameters that are sharded in different ways.

``torch.nn.utils.clip_grad_norm_`` needs every gradient on one mesh; under FSDP x TP the
norms' weights live on the data-parallel mesh and the matrices on the 2-D mesh, plain
tensors may be left unsharded, and each pipeline stage holds different parameters.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def total_grad_norm(grads: list[torch.Tensor], ctx) -> torch.Tensor:
    """The global L2 norm of ``grads`` (every rank's, the whole unsharded gradients): a group of
    gradients on one mesh gives its norm as a DTensor whose ``full_tensor()`` is the norm of the
    whole; plain tensors are whole already (replicated over tensor-parallel ranks, so counted
    once); pipeline stages add their squared norms."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    return ctx.all_reduce_pp(total_sq).sqrt()


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, ctx) -> torch.Tensor:
    """Clip to a global L2 norm ``max_norm`` (0: no clipping); return the norm before clipping
    (``total_grad_norm``)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, ctx)
    if max_norm > 0:
        # scale the gradients themselves (a DTensor's local shard on each rank) by torch's
        # coefficient; torch.nn.utils.clip_grads_with_norm_ takes parameters and reads their
        # .grad, so handed gradients (as this code once did) it silently clipped nothing
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total
