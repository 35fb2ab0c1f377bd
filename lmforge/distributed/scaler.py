"""fp16's dynamic loss scaling when the gradients are spread over ranks.

``torch.amp.GradScaler`` decides per process whether the step's gradients overflowed. A
distributed run must decide once for all ranks: a step skipped on one pipeline stage and taken
on another leaves the model half-updated, and the ranks' loss scales drift apart. DTensor
already all-reduces the check over each DTensor's mesh (FSDP, TP); pipeline stages hold
different parameters, so the verdict is all-reduced over the whole world here, as torch's
FSDP1 ``ShardedGradScaler`` does over its process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DistributedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with one overflow verdict per step for every rank of the run."""

    def __init__(self, device: torch.device):
        super().__init__(device.type)
        self.device = device
        # the scale is created by the first scale() call; an early pipeline stage never scales a loss
        self.scale(torch.zeros((), device=device))

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # noqa: ANN001 (torch's signature)
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        verdict = torch.zeros((), dtype=torch.float32, device=self.device)
        for flag in per_device.values():
            verdict = torch.maximum(verdict, flag.to(self.device))
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        for flag in per_device.values():
            flag.copy_(verdict)
        if not per_device:  # a rank without gradients still takes part in step() and update()
            per_device[found_inf.device] = found_inf.copy_(verdict)
        return per_device
