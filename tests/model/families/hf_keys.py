"""The config.json key checks every family's import shares, driven by one ``HfKeys`` spec a family's test file
declares (``HF_KEYS``); tests/model/families/test_hf_config_keys.py runs them for each spec it finds. A key is
classified honoured, refused or inert (``lmforge.model.hf_parts``), and the class holds against transformers: a
key that changes the arithmetic, set away from its default, is either honoured (the import computes
transformers' logits) or refused (InputError naming it, nothing written), never dropped; a key called inert
changes neither lmforge's ModelConfig nor transformers' logits. Also the helpers the family tests share:
``randomize_``, ``logits``, ``INERT_SAMPLES``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.load import load_model
from lmforge.core.io import InputError
from lmforge.model.hf import HF_CONFIG_KEYS, model_config_from_hf
from lmforge.model.hf_parts import HONOURED, INERT, REFUSED, supports
from lmforge.stages.import_hf import ImportRecipe, run_import

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
INERT_SAMPLES = {  # values a real config.json carries; the rest get a generic one
    "bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 7, "sep_token_id": 8, "decoder_start_token_id": 9,
    "use_cache": False, "dtype": "bfloat16", "torch_dtype": "bfloat16", "initializer_range": 0.5, "pretraining_tp": 2,
    "output_attentions": True, "output_hidden_states": True, "chunk_size_feed_forward": 4, "is_llama_config": True,
    "attention_bias": True, "mlp_bias": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
    "layer_types": ["sliding_attention", "sliding_attention"], "transformers_version": "4.40.1",
}
CACHE_ONLY = ("transformers' forward ignores it, but its DynamicCache keeps only the window of a layer it names "
              "sliding, so cached decoding differs from a recompute: lmforge refuses the ambiguity")


def randomize_(model: torch.nn.Module) -> torch.nn.Module:
    """Norm gains and biases random too, so a mis-mapped one shows; the same values at every call."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.ndim == 1 and "norm" in name else 0.0
            p.copy_(base + (0.1 if p.ndim == 1 else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


def from_folder(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def _same(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return weights


def lookup(table: dict, model_type: str, key: str, default: object = None) -> object:
    """A table's entry for the key: under (model_type, key), else ("*", key), else the bare key (one-class families)."""
    for name in ((model_type, key), ("*", key), key):
        if name in table:
            return table[name]
    return default


@dataclasses.dataclass(frozen=True)
class HfKeys:
    """One family's transformers config classes and what its key checks need to know of them.

    ``variants``, ``not_on_eval_logits`` are keyed by (model_type or "*", key), or by the bare key where the family
    has one class: a variant is (what else the pair of configs sets, the key's value away from the default)."""

    family: str
    classes: dict[str, type]  # model_type -> transformers' config class
    base: dict[str, dict]  # model_type -> the tiny model's fields
    variants: dict
    not_on_eval_logits: dict  # keys whose change a tiny model cannot show on its eval logits, and why
    model_class: type  # what lmforge's import builds
    inert_samples: dict = dataclasses.field(default_factory=lambda: dict(INERT_SAMPLES))
    min_inert_checked: int = 10
    inert_must_check: frozenset[str] = frozenset()
    dropouts: dict[str, str] = dataclasses.field(default_factory=lambda: {"attention_dropout": "attn_dropout"})
    unapplied_dropouts: frozenset[str] = frozenset()  # the class defines them but its model applies none
    partly_honoured: str = "hidden_act"  # an honoured key whose reader takes some values only
    unknown_key: tuple[str, object] = ("attn_logit_softcapping", 50.0)
    in_memory: Callable[[dict], dict] = _same  # the saved weights as transformers holds them once loaded
    randomize: Callable[[torch.nn.Module], torch.nn.Module] = randomize_  # random weights, every gain and bias too
    alias_of: dict[str, str] = dataclasses.field(default_factory=dict)  # attribute_map's name -> the class's own
    unclassified_aliases: frozenset[str] = frozenset()  # attribute_map names lmforge refuses as unknown keys
    check_import: Callable[[torch.nn.Module, str, str, object], None] | None = None  # a family's own assertions

    def keys(self, model_type: str, kind: str | None = None) -> list[str]:
        return sorted(k for k, spec in HF_CONFIG_KEYS[model_type].items() if kind is None or spec.kind == kind)

    def arithmetic_keys(self) -> list[tuple[str, str]]:
        return [(t, k) for t in self.classes for k in self.keys(t) if HF_CONFIG_KEYS[t][k].kind != INERT
                and k not in ("model_type", "architectures")]  # these pick the class: the families' type tests

    def make_config(self, model_type: str, **fields) -> transformers.PretrainedConfig:
        """The class's config of ``fields``, copied first: transformers' classes edit the dicts they are given."""
        return self.classes[model_type](**copy.deepcopy({**self.base[model_type], **fields}))

    def build_folder(self, path: Path, model_type: str, fields: dict, patch: dict, drop: tuple[str, ...] = ()
                     ) -> torch.nn.Module:
        """A random model of ``fields`` saved by transformers, its config.json then holding ``patch`` verbatim
        and none of ``drop``."""
        config = self.make_config(model_type, **fields)
        model = self.randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
        model.save_pretrained(path)
        saved = json.loads((path / "config.json").read_text())
        written = {k: v for k, v in {**saved, **copy.deepcopy(patch)}.items() if k not in drop}
        (path / "config.json").write_text(json.dumps(written))
        return model

    def variant(self, model_type: str, key: str) -> tuple[dict, object]:
        """(the pair's shared fields, the key's value): copies, since transformers' config classes edit what they are given."""
        return copy.deepcopy(lookup(self.variants, model_type, key))


def check_every_key_transformers_defines_is_classified(spec: HfKeys, model_type: str) -> None:
    """A key a newer transformers adds to the class (or to PretrainedConfig, or a name of its attribute_map)
    fails here until it is classified; an attribute_map name left unclassified is refused, naming it."""
    cls = spec.classes[model_type]
    defined = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    defined |= set(transformers.PretrainedConfig().to_dict()) | set(cls.attribute_map) - spec.unclassified_aliases
    assert sorted(defined - HF_CONFIG_KEYS[model_type].keys()) == []
    assert {s.kind for s in HF_CONFIG_KEYS[model_type].values()} == {HONOURED, REFUSED, INERT}
    for alias in sorted(spec.unclassified_aliases):
        with pytest.raises(InputError, match=rf"^x/config.json: key '{alias}' = 1 is not one lmforge knows"):
            model_config_from_hf({**spec.make_config(model_type).to_dict(), alias: 1}, where="x/config.json")


def keys_without_a_variant(spec: HfKeys) -> list[tuple[str, str]]:
    return [(t, k) for t, k in spec.arithmetic_keys() if lookup(spec.variants, t, k) is None]


def dropping_reader_differs(spec: HfKeys, folder: Path, model_type: str, base: dict, theirs: torch.nn.Module) -> bool:
    """Whether a reader that drops the key computes something else: transformers' model of the config without
    it, holding the folder's weights (a tensor of another shape, or one it lacks, counts as different)."""
    plain = transformers.AutoModelForCausalLM.from_config(spec.make_config(model_type, **base), attn_implementation="eager")
    plain = spec.randomize(plain)
    weights = spec.in_memory(load_file(str(folder / "model.safetensors")))
    expected = plain.state_dict()
    if any(k in expected and expected[k].shape != v.shape for k, v in weights.items()) or weights.keys() - expected.keys():
        return True
    plain.load_state_dict(weights, strict=False)
    return (logits(plain) - logits(theirs)).abs().max().item() > 1e-4


def check_a_key_that_changes_the_arithmetic(spec: HfKeys, tmp_path: Path, model_type: str, key: str) -> None:
    """Set away from its default, the key is honoured (lmforge's import computes transformers' logits) or refused
    (one line naming it, nothing written); and the test can fail: dropping the key changes the logits."""
    base, value = spec.variant(model_type, key)
    own = spec.alias_of.get(key, key)  # an attribute_map name: the class is given its own, the folder the alias only
    try:
        spec.make_config(model_type, **{**base, own: value})
        fields = {**base, own: value}
    except Exception:  # noqa: BLE001  (a key the class does not take: the folder's weights are the base model's)
        fields = base
    spec.build_folder(tmp_path / "hf", model_type, fields, {**base, key: value}, drop=(own,) if own != key else ())
    try:
        theirs = from_folder(tmp_path / "hf")
    except Exception:  # noqa: BLE001
        theirs = None
    unshown = lookup(spec.not_on_eval_logits, model_type, key) is not None
    assert theirs is not None or unshown, f"transformers cannot build {key}={value!r}; say why in NOT_ON_EVAL_LOGITS"
    if key in spec.dropouts:
        torch.manual_seed(0)
        moved = (logits(theirs.train()) - logits(theirs.eval())).abs().max().item()
        assert moved == 0.0 if key in spec.unapplied_dropouts else moved > 1e-3
    elif not unshown:
        assert dropping_reader_differs(spec, tmp_path / "hf", model_type, base, theirs)

    kind = HF_CONFIG_KEYS[model_type][key]
    refused = not supports(kind, value, json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert refused == (kind.kind == REFUSED) or key == spec.partly_honoured
    if refused:
        with pytest.raises(InputError, match=rf"hf/config.json: {key} = .* is not supported") as info:
            run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
        assert "\n" not in str(info.value)
        assert not (tmp_path / "ckpt").exists()
        return
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert type(ours) is spec.model_class
    assert theirs is not None, f"{key}={value!r} is honoured but transformers cannot build it: nothing to compare"
    assert (logits(ours) - logits(theirs.eval())).abs().max().item() <= 1e-5
    if key == "max_position_embeddings":
        assert ours.cfg.max_seq_len == value
    if key in spec.dropouts:
        assert getattr(ours.cfg, spec.dropouts[key]) == value
    if spec.check_import is not None:
        spec.check_import(ours, model_type, key, value)


def check_inert_keys(spec: HfKeys, tmp_path: Path, model_type: str) -> None:
    """Each key called inert, set to a sample value: the same ModelConfig (initializer_range only moves init_std),
    and, for those with a meaningful sample, the logits transformers computes from the folder do not move."""
    spec.build_folder(tmp_path / "plain", model_type, {}, {})
    plain_json = json.loads((tmp_path / "plain" / "config.json").read_text())
    plain_cfg = model_config_from_hf(plain_json)
    reference = logits(from_folder(tmp_path / "plain"))
    checked = []
    for key in spec.keys(model_type, INERT):
        sample = spec.inert_samples.get(key, "lmforge-test")
        cfg = model_config_from_hf({**plain_json, key: sample})
        expected = dataclasses.replace(plain_cfg, init_std=sample) if key == "initializer_range" else plain_cfg
        assert cfg == expected, key
        if key in spec.inert_samples:
            (tmp_path / "plain" / "config.json").write_text(json.dumps({**plain_json, key: sample}))
            assert (logits(from_folder(tmp_path / "plain")) - reference).abs().max().item() == 0.0, key
            checked.append(key)
    assert len(checked) >= spec.min_inert_checked and spec.inert_must_check <= set(checked), checked


def check_an_unknown_key_is_refused_naming_it(spec: HfKeys, model_type: str) -> None:
    key, value = spec.unknown_key
    config = {**spec.make_config(model_type).to_dict(), key: value}
    with pytest.raises(InputError, match=rf"^x/config.json: key '{key}' = {re.escape(repr(value))} is not one lmforge "
                                         rf"knows for model_type '{model_type}': lmforge does not know what it does") as info:
        model_config_from_hf(config, where="x/config.json")
    assert "\n" not in str(info.value)
