"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that
maps every parameter's and optimizer tensor's fully-qualified name to the pieces on disk.
Names are those of the unsharded model, and optimizer state is flattened by name, so a
checkpoint loads into any other layout, world size, or a single process.

DCP pickles ``.metadata`` and the non-tensor values (the optimizer's hyperparameters), and its
reader unpickles them with every class allowed: a crafted checkpoint would run code. lmforge
reads them through ``SafeReader`` and ``SafeLoadPlanner`` instead, which build only DCP's own
metadata records and plain values, and keep every shard path inside the checkpoint.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lmforge.core.io import InputError

METADATA = ".metadata"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# What DCP's .metadata pickle may build: its own records, tensor sizes, dtypes, layouts and
# memory formats, and the path it records as the checkpoint id. Nothing else is looked up.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: str | Path) -> Metadata:
    """A DCP ``.metadata`` file, unpickled with only the classes DCP's metadata is made of;
    anything else (a crafted file that would run code) is an ``InputError``."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: not the metadata of a sharded checkpoint lmforge can read safely ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise InputError(f"{path}: not the metadata of a sharded checkpoint (a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or pathlib.PurePath(name).name != name or name in ("", ".", ".."):
            raise InputError(f"{path}: names a shard {name!r} outside the checkpoint directory")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with ``read_metadata`` confined as above (read once per reader)."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner reading non-tensor values with ``torch.load(weights_only=True)`` (plain
    numbers, strings, tuples, containers: an optimizer's hyperparameters) instead of any pickle."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 (torch's signature)
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError or RuntimeError for what it refuses
            raise InputError(f"sharded checkpoint value {fqn}: refused, not a plain value ({exc})") from exc
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


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
    safe_load(state, directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=OPTIONS)


def model_tensor_sizes(reader: SafeReader) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each model tensor's key (``model.<name>``), size and dtype, from a sharded checkpoint's metadata."""
    return {key: (meta.size, meta.properties.dtype) for key, meta in reader.read_metadata().state_dict_metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def safe_load(state: dict, directory: str | Path, reader: SafeReader | None = None, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``directory`` through ``SafeReader`` and ``SafeLoadPlanner``. DCP
    wraps every rank's error in a ``CheckpointException`` (a ``BaseException``): a refusal comes
    out as the ``InputError`` it was, any other failure as one naming the checkpoint."""
    try:
        dcp.load(state, storage_reader=reader or SafeReader(str(directory)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        errors = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        refused = [e for e in errors if isinstance(e, InputError)]
        if refused:
            message = str(refused[0])
            raise InputError(message if str(directory) in message else f"{directory}: {message}") from exc
        raise InputError(f"{directory}: cannot read the sharded checkpoint: {errors[0] if errors else exc}") from exc


def _load_alone(state: dict, reader: SafeReader) -> None:
    with warnings.catch_warnings():  # no_dist is the intent here: torch's "assuming single process" is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        safe_load(state, reader.path, reader, no_dist=True)


def read_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from a sharded checkpoint, read by this process alone (no
    process group needed), whatever layout wrote it."""
    reader = SafeReader(str(directory))
    state = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in model_tensor_sizes(reader).items()}
    _load_alone(state, reader)
    return {key.removeprefix("model."): value for key, value in state.items()}


def iter_model_state(directory: str | Path, max_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
    """``read_model_state`` a group of at most ``max_bytes`` (or one tensor) at a time, so that a
    model larger than this process's memory can be scanned."""
    reader = SafeReader(str(directory))
    group: dict[str, torch.Tensor] = {}
    for key, (size, dtype) in model_tensor_sizes(reader).items():
        group[key] = torch.empty(size, dtype=dtype)
        if sum(t.nbytes for t in group.values()) >= max_bytes:
            _load_alone(group, reader)
            yield from ((k.removeprefix("model."), v) for k, v in group.items())
            group = {}
    if group:
        _load_alone(group, reader)
        yield from ((k.removeprefix("model."), v) for k, v in group.items())
