"""Transformations applied to a built model, in torchtitan's order: TP, activation checkpointing, compile, FSDP.

The model code knows nothing about them; each function takes a model whose blocks are
``model.layers`` and changes it in place. Parameter names are unchanged.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block separately: one graph reused by every layer, so compiling is quick."""
    for block in model.layers:
        block.compile(dynamic=False)
