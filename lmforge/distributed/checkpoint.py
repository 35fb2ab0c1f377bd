"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that
maps every parameter's and optimizer tensor's fully-qualified name to the pieces on disk.
Names are those of the unsharded model, and optimizer state is flattened by name, so a
checkpoint loads into any other layout, world size, or a single process.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

METADATA = ".metadata"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_sharded_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / METADATA).is_file()


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's view of the model and optimizer state, keyed by the unsharded names."""
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": model_state, "optimizer": optim_state}


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 async_group=None) -> Future | None:
    """Write this rank's shards (every rank calls this). With ``async_group`` (a gloo group) the
    state is copied first and written in the background: wait on the returned future."""
    state = sharded_state(model, optimizer)
    if async_group is not None:
        return dcp.async_save(state, checkpoint_id=str(directory), process_group=async_group)
    dcp.save(state, checkpoint_id=str(directory))
    return None


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` as laid out now (any layout)."""
    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=OPTIONS)


def read_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from a sharded checkpoint, read by this process alone (no
    process group needed), whatever layout wrote it."""
    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no_dist is the intent here: torch's "assuming single process" is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}
