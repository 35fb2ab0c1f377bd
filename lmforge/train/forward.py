"""How the loop runs an objective's forward: on which device, under which autocast precision,
and inside which loss layout (tensor parallelism's vocabulary-sharded cross-entropy).

Shared by the step runners (``train.step``) and evaluation (``train.evaluate``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lmforge.distributed.mesh import ParallelContext

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallelism is a replicated DTensor: its plain value."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def loss_context(parallel: ParallelContext) -> contextlib.AbstractContextManager:
    """Cross-entropy over vocabulary-sharded logits, where tensor parallelism keeps them sharded."""
    layout = parallel.layout
    if layout.tp > 1 and layout.pp == 1 and parallel.cfg.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()


def batch_rows(batch: Any) -> int:
    """Rows of a batch: a tensor's first dimension, or that of a dict of tensors (SFT and preference rows)."""
    return len(next(iter(batch.values()))) if isinstance(batch, dict) else len(batch)
