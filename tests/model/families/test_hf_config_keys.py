"""Every family's config.json keys held against transformers (tests/model/families/hf_keys.py's checks), for
each ``HF_KEYS`` spec of tests/model/test_hf_fields.py (the llama family) and of tests/model/families/test_*.py,
found as tests/model/test_parity.py finds the families' ``PARITY_VARIANTS``. A test's id names the family, the
model_type where the family has several, and the key."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.model.families
from tests.model.families import hf_keys

SPECS: list[hf_keys.HfKeys] = [importlib.import_module("tests.model.test_hf_fields").HF_KEYS]
for _module in pkgutil.iter_modules(tests.model.families.__path__):
    if _module.name.startswith("test_") and _module.name != __name__.rsplit(".", 1)[-1]:
        _spec = getattr(importlib.import_module(f"tests.model.families.{_module.name}"), "HF_KEYS", None)
        SPECS += [_spec] if _spec is not None else []


def named(spec: hf_keys.HfKeys, model_type: str) -> str:
    return spec.family if model_type == spec.family else f"{spec.family}:{model_type}"


CLASSES = [(s, t) for s in SPECS for t in s.classes]
CLASS_IDS = [named(s, t) for s, t in CLASSES]
KEYS = [(s, t, k) for s in SPECS for t, k in s.arithmetic_keys()]


@pytest.mark.parametrize("spec, model_type", CLASSES, ids=CLASS_IDS)
def test_every_key_transformers_defines_is_classified(spec, model_type):
    hf_keys.check_every_key_transformers_defines_is_classified(spec, model_type)


@pytest.mark.parametrize("spec", SPECS, ids=[s.family for s in SPECS])
def test_every_arithmetic_key_has_a_variant(spec):
    assert hf_keys.keys_without_a_variant(spec) == []


@pytest.mark.parametrize("spec, model_type, key", KEYS, ids=[f"{named(s, t)}-{k}" for s, t, k in KEYS])
def test_a_key_that_changes_the_arithmetic_is_honoured_with_equal_logits_or_refused(tmp_path, spec, model_type, key):
    hf_keys.check_a_key_that_changes_the_arithmetic(spec, tmp_path, model_type, key)


@pytest.mark.parametrize("spec, model_type", CLASSES, ids=CLASS_IDS)
def test_inert_keys_change_neither_the_model_config_nor_transformers_logits(tmp_path, spec, model_type):
    hf_keys.check_inert_keys(spec, tmp_path, model_type)


@pytest.mark.parametrize("spec, model_type", CLASSES, ids=CLASS_IDS)
def test_a_key_lmforge_does_not_know_is_refused_naming_it(spec, model_type):
    hf_keys.check_an_unknown_key_is_refused_naming_it(spec, model_type)


def test_every_model_type_lmforge_imports_has_a_spec():
    """A family whose config.json keys lmforge classifies is held here: the specs' classes are every model_type."""
    from lmforge.model.hf import HF_CONFIG_KEYS

    assert sorted(t for s in SPECS for t in s.classes) == sorted(HF_CONFIG_KEYS)
