"""The registry of model families: one line per family (its folder declares the rest, ``model.family``).

``build`` is how every caller makes a model from a config; ``model_config`` makes the config
of a saved or written mapping (its ``family`` key picks the class); ``family_of`` reaches a
config's or a model's declaration; ``hf_family`` the family that imports a ``model_type``.
"""

from __future__ import annotations

from typing import Any

from lmforge.model.families import deepseek_v3, gemma, gpt2, llama, mixtral, olmo2, phi3
from lmforge.model.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    gemma.FAMILY,
    olmo2.FAMILY,
    phi3.FAMILY,
    gpt2.FAMILY,
    mixtral.FAMILY,
    deepseek_v3.FAMILY,
)}

# every family's presets by name, each with its family named
PRESETS: dict[str, dict] = {name: {"family": f.name, **fields} for f in FAMILIES.values() for name, fields in f.presets.items()}
_duplicates = [n for n in PRESETS if sum(n in f.presets for f in FAMILIES.values()) > 1]
assert not _duplicates, f"presets named by two families: {_duplicates}"


def family_of(cfg_or_model: Any) -> Family:
    """The declaration of a config's family (or a model's: its ``cfg``)."""
    cfg = getattr(cfg_or_model, "cfg", cfg_or_model)
    return FAMILIES[cfg.family]


def model_config(data: dict[str, Any]):
    """The config a mapping describes (``model_config.json``, a Python dict): its ``family``'s class."""
    name = data.get("family", "llama")
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name].config(**data)


def build(cfg):
    """The model of ``cfg``: its family's model class, initialised (under ``torch.device('meta')``, shapes only)."""
    return family_of(cfg).model(cfg)


def hf_family(model_type: Any) -> Family | None:
    """The family that imports a ``config.json`` of ``model_type``, or None."""
    return next((f for f in FAMILIES.values() if f.hf is not None and model_type in f.hf.classes), None)


def hf_classes() -> dict[str, str]:
    """Every ``model_type`` import reads -> its transformers class, across families."""
    return {t: cls for f in FAMILIES.values() if f.hf is not None for t, cls in f.hf.classes.items()}


def families_table() -> str:
    """A Markdown table of the registered families: what each is, the Hugging Face classes import and
    export read and write, and its presets (``lmforge import --help`` and the README print it)."""
    rows = ["| family | what it is | Hugging Face classes | presets |", "|---|---|---|---|"]
    for f in FAMILIES.values():
        classes = ", ".join(f"`{cls}`" for cls in dict.fromkeys(f.hf.classes.values())) if f.hf else "none"
        presets = ", ".join(f"`{p}`" for p in f.presets) or "none"
        rows.append(f"| `{f.name}` | {f.summary} | {classes} | {presets} |")
    return "\n".join(rows)
