"""What a model family declares, in one place (``lmforge.model.families``).

A family is a folder under ``model/families/`` whose ``__init__.py`` builds one ``Family``:
its config class (``ModelConfig`` or a subclass adding the family's fields; the class also
holds the parameter counts, ``ModelConfig.param_counts``), its model class (``Transformer`` or
a subclass whose blocks are built from the shared parts in ``model.transformer``; the class
holds the tensor-parallel plan, ``Transformer.tp_plan``), its presets, whether the decoding
layout of ``model.fused`` applies, and its Hugging Face mapping. The training loop, the
inference engine, the memory planner, LoRA targeting, export/import and the parity test reach
a family only through this record; adding one is its folder, a line in ``families/__init__.py``
and its tests (torchtitan's ``ModelSpec`` is the same idea).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmforge.model.config import ModelConfig
    from lmforge.model.hf_parts import HFKey
    from lmforge.model.transformer import Transformer


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face interop: which ``config.json`` it reads, and how weights map.

    ``classes``: each ``model_type`` it imports -> the one ``architectures`` class it computes.
    ``config_keys``: per model_type, every ``config.json`` key classified (honoured, refused
    unless at a value lmforge computes, or inert; ``hf_parts.check_hf_config_keys`` refuses the rest).
    ``config_from_hf(config, where)``: the family's config (an ``InputError`` naming ``where``).
    ``config_to_hf(cfg, dtype, **extra)``: a ``config.json`` for the class that computes ``cfg``
    exactly (a ``ValueError`` when no class does). ``state_to_hf(state, cfg)`` / ``state_from_hf``:
    weights under the other side's names and layouts. ``name_to_hf`` / ``name_from_hf``: one
    module or parameter name (PEFT adapters), None where the layouts are not one to one.
    """

    classes: dict[str, str]
    config_keys: dict[str, dict[str, HFKey]]
    config_from_hf: Callable[[dict, str], ModelConfig]
    config_to_hf: Callable[..., dict]  # (cfg, dtype="float32", **extra)
    state_to_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    state_from_hf: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]
    name_to_hf: Callable[[str], str] | None = None
    name_from_hf: Callable[[str], str] | None = None

    @classmethod
    def from_module(cls, hf: ModuleType) -> HFMapping:
        """A family's ``hf.py`` read by its names: ``CLASSES``, ``CONFIG_KEYS``, ``model_config_from_hf``,
        ``hf_config_dict``, ``state_dict_to_hf``, ``state_dict_from_hf`` and, where the weights' names
        map one to one, ``to_hf_name`` / ``from_hf_name``."""
        return cls(classes=hf.CLASSES, config_keys=hf.CONFIG_KEYS, config_from_hf=hf.model_config_from_hf,
                   config_to_hf=hf.hf_config_dict, state_to_hf=hf.state_dict_to_hf, state_from_hf=hf.state_dict_from_hf,
                   name_to_hf=getattr(hf, "to_hf_name", None), name_from_hf=getattr(hf, "from_hf_name", None))


@dataclass(frozen=True)
class Family:
    """One model family's declaration (see the module docstring)."""

    name: str
    summary: str  # one line: what it is; ``lmforge import --help`` and the README list it
    config: type[ModelConfig]
    model: type[Transformer]
    presets: dict[str, dict] = field(default_factory=dict)  # name -> fields (the family is added)
    hf: HFMapping | None = None
    decoding_layout: bool = True  # model.fused's joined q/k/v and w1/w3 apply to its blocks
