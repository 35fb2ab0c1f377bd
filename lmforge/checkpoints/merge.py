"""Merged checkpoints: the weights of several checkpoints of one model combined by a merge rule
(``lmforge.peft.merge.combine``), or a base with merged LoRA updates added, written as a checkpoint
directory that every verb loads (``model.safetensors``, ``model.json``, the tokenizer,
``checksums.json`` last).

For inputs θ_i with weights w_i and, where the method has one, a base θ_b and scale λ:

- ``linear``:           θ = Σ_i w_i θ_i / Σ_i w_i  (a weighted average; weights 1: the mean)
- ``task_arithmetic``:  θ = θ_b + λ Σ_i w_i (θ_i − θ_b)  (Ilharco et al. 2023)
- ``ties``, ``dare_linear``, ``dare_ties``, ``magnitude_prune``: θ = θ_b + λ·τ, τ the rule's merge of τ_i = θ_i − θ_b

Every tensor is combined in float32 and stored in the first input's dtype; tensors that are not
floating point must be equal in every input. Inputs with a ``model.safetensors`` are read one
tensor at a time (``weights_view``), so a merge holds the merged model and one tensor per input,
not every input whole; a distributed (DCP) checkpoint is read whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmforge.checkpoints.files import WEIGHTS, write_checksums, write_model_config
from lmforge.checkpoints.load import check_finite_checkpoint, read_checkpoint_weights
from lmforge.core.io import InputError
from lmforge.data.chat import add_chat_template
from lmforge.model.config import ModelConfig
from lmforge.peft.merge import KeepMask, combine, seeded_keep_mask

CHECKPOINT_METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "magnitude_prune")
# what may differ between the configs of checkpoints that merge: training-only settings
TRAINING_ONLY = ("embed_dropout", "attn_dropout", "resid_dropout", "preset")


def model_config_difference(a: ModelConfig, b: ModelConfig) -> str | None:
    """The first field (not a dropout) in which two models' configs differ, as ``'d_model' (64 vs 32)``;
    None when their weights mean the same thing."""
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    for key in [*left, *(k for k in right if k not in left)]:
        if key not in TRAINING_ONLY and left.get(key) != right.get(key):
            return f"'{key}' ({left.get(key)!r} vs {right.get(key)!r})"
    return None


class SafetensorsWeights(Mapping):
    """A checkpoint's ``model.safetensors`` as a read-only mapping of name to tensor, each tensor
    read when it is looked up (memory-mapped), with its shape and dtype known without reading it."""

    def __init__(self, path: Path):
        self.path = path
        self._file = safe_open(str(path), framework="pt")
        self._keys = list(self._file.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._keys:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())


def weights_view(directory: Path) -> Mapping[str, torch.Tensor]:
    """A checkpoint's weights to merge: ``model.safetensors`` read tensor by tensor (its weights checked
    finite first, one tensor at a time), or a distributed checkpoint's gathered whole."""
    if (directory / WEIGHTS).is_file():
        check_finite_checkpoint(directory)
        try:
            return SafetensorsWeights(directory / WEIGHTS)
        except Exception as exc:  # safetensors raises its own error types for truncated files
            raise InputError(f"{directory / WEIGHTS}: cannot read weights: {exc}") from exc
    return read_checkpoint_weights(directory)


def tensor_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    return weights.shape(name) if isinstance(weights, SafetensorsWeights) else tuple(weights[name].shape)


def merge_states(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], method: str,
                 base: Mapping[str, torch.Tensor] | None = None, scale: float = 1.0, density: float = 1.0,
                 drop_rate: float = 0.0, seed: int = 0, keep_mask: KeepMask | None = None) -> dict[str, torch.Tensor]:
    """The inputs' weights merged by ``method`` (the module's docstring gives each equation); every
    state must have the same names and shapes, and ``base`` too where the method reads one."""
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint merge method {method!r} is unknown; choose one of {', '.join(CHECKPOINT_METHODS)}")
    if (method == "linear") != (base is None):
        raise ValueError(f"{method}: {'no base' if method == 'linear' else 'a base'} is needed")
    keep_mask = keep_mask or seeded_keep_mask(seed)
    rule = "linear" if method == "task_arithmetic" else method
    merged = {}
    for name in states[0]:
        tensors = [state[name] for state in states]
        first = tensors[0]
        if not first.is_floating_point():
            if any(not torch.equal(first, t) for t in tensors[1:]):
                raise InputError(f"{name}: not floating point, and not the same in every input: it cannot be averaged")
            merged[name] = first
            continue
        x = [t.float() for t in tensors]
        if method == "linear":
            value = sum(w * t for w, t in zip(weights, x)) / sum(weights)
        else:
            b = base[name].float()
            value = b + scale * combine([t - b for t in x], weights, rule, density, drop_rate, keep_mask, name)
        merged[name] = value.to(first.dtype)
    return merged


def add_deltas(state: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``state`` with each ``deltas[name]`` added to the weight ``name`` (in float32, stored back in
    the weight's dtype): merged LoRA updates folded into their base."""
    out = dict(state)
    for name, delta in deltas.items():
        if name not in state:
            raise InputError(f"{where}: the adapters update {name}, which the base has not (a tied output matrix?)")
        if state[name].shape != delta.shape:
            raise InputError(f"{where}: the adapters' update of {name} has shape {tuple(delta.shape)}, the base's weight "
                             f"{tuple(state[name].shape)}: the adapters were trained on another base")
        out[name] = (state[name].float() + delta).to(state[name].dtype)
    return out


def write_checkpoint_files(directory: Path, state: dict[str, torch.Tensor], cfg: ModelConfig,
                           tokenizer_dir: Path | None, chat_template: str | None = None) -> None:
    """A checkpoint's files in ``directory`` (a temporary folder the caller renames into place):
    ``model.safetensors``, ``model.json``, the tokenizer of ``tokenizer_dir`` (if any; with
    ``chat_template`` stored in its config), anything the caller wrote there before, and
    ``checksums.json`` last."""
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(directory / WEIGHTS), metadata={"format": "pt"})
    write_model_config(directory, cfg, tokenizer_dir)
    if tokenizer_dir is not None and chat_template is not None:
        add_chat_template(directory, chat_template)
    write_checksums(directory)
