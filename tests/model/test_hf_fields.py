"""Every config.json key of the four classes lmforge imports is classified in ``HF_CONFIG_KEYS``,
and the class holds against transformers: a key that changes the arithmetic, set away from its
default, is either honoured (the import computes transformers' logits) or refused (InputError naming
it), never dropped; a key called inert changes neither lmforge's ModelConfig nor transformers' logits."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.checkpoints.load import load_model
from lmforge.core.io import InputError
from lmforge.model.hf import HF_CONFIG_KEYS, SUPPORTED_ARCHITECTURES, model_config_from_hf
from lmforge.model.hf_parts import HONOURED, INERT, REFUSED, supports
from lmforge.stages.import_hf import ImportRecipe, run_import

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a dev dependency: the reference these tests compare against)

CLASSES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)  # Qwen's window, on every layer

# (model_type or "*", key) -> (what else the pair of configs sets, the value away from the default); a window of 8
# on 32 tokens, biases, norms and RoPE of the tiny model all move the logits by far more than 1e-5
VARIANTS: dict[tuple[str, str], tuple[dict, object]] = {
    ("*", "vocab_size"): ({}, 301),
    ("*", "hidden_size"): ({}, 96),
    ("*", "intermediate_size"): ({}, 96),
    ("*", "num_hidden_layers"): ({}, 3),
    ("*", "num_attention_heads"): ({}, 8),
    ("*", "num_key_value_heads"): ({}, 1),
    ("*", "head_dim"): ({}, 32),
    ("*", "rms_norm_eps"): ({}, 0.5),
    ("*", "tie_word_embeddings"): ({}, True),
    ("*", "max_position_embeddings"): ({}, 128),
    ("*", "hidden_act"): ({}, "gelu"),
    ("*", "rope_parameters"): ({}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ("*", "rope_scaling"): ({}, {"rope_type": "linear", "factor": 4.0}),  # transformers < 5's spelling
    ("*", "rope_theta"): ({}, 300.0),
    ("*", "original_max_position_embeddings"): (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, 16),
    ("*", "attention_dropout"): ({}, 0.1),
    ("*", "partial_rotary_factor"): ({}, 0.5),
    ("*", "rope_interleaved"): ({}, True),
    ("*", "quantization_config"): ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("*", "pruned_heads"): ({}, {"0": [1]}),
    ("*", "auto_map"): ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
    ("*", "attention_bias"): ({}, True),
    ("*", "mlp_bias"): ({}, True),
    ("mistral", "sliding_window"): ({}, 8),
    ("*", "use_sliding_window"): ({**WINDOW, "use_sliding_window": False}, True),
    ("*", "sliding_window"): ({**WINDOW, "sliding_window": None}, 8),
    ("*", "max_window_layers"): ({**WINDOW, "max_window_layers": 28}, 1),
    ("*", "layer_types"): ({**WINDOW, "max_window_layers": 28}, ["sliding_attention", "full_attention"]),
}
_CACHE_ONLY = ("transformers' forward ignores it, but its DynamicCache keeps only the window of a layer it names "
               "sliding, so cached decoding differs from a recompute: lmforge refuses the ambiguity")
# keys whose change a tiny model cannot show on its logits in eval mode, and why (or what the test checks instead)
NOT_ON_EVAL_LOGITS = {
    ("llama", "sliding_window"): _CACHE_ONLY,
    ("llama", "layer_types"): _CACHE_ONLY,
    ("mistral", "layer_types"): _CACHE_ONLY,
    ("*", "max_position_embeddings"): "the context bound: no effect on a shorter input with plain RoPE (dynamic NTK and windows "
                               "read it: tests/model/test_rope.py, tests/model/test_sliding_window.py); the import must keep it",
    ("*", "attention_dropout"): "acts in training only: the test checks transformers' train-mode logits move",
    ("*", "partial_rotary_factor"): "transformers 5's Llama-line classes drop it; the weights of a folder that sets it expect part of "
                             "each head unrotated (Phi, StableLM, GPT-NeoX), so lmforge refuses rather than guess",
    ("*", "rope_interleaved"): "nanotron's flag; transformers ignores it, but weights trained with interleaved pairs need their q/k "
                        "rows permuted before rotate_half computes them",
    ("*", "quantization_config"): "building a quantized model needs a quantization backend; the weights are not plain matrices",
    ("*", "pruned_heads"): "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    ("*", "auto_map"): "custom modelling code (trust_remote_code) computes the model; the test builds none",
}


def make_config(model_type: str, **fields) -> transformers.PretrainedConfig:
    """The class's config of ``fields``, copied first: transformers' classes edit the dicts they are given."""
    return CLASSES[model_type](**copy.deepcopy({**BASE, **fields}))


def keys_of(model_type: str, kind: str | None = None) -> list[str]:
    return sorted(k for k, spec in HF_CONFIG_KEYS[model_type].items() if kind is None or spec.kind == kind)


def variant(model_type: str, key: str) -> tuple[dict, object]:
    """(the pair's shared fields, the key's value): copies, since transformers' config classes edit what they are given."""
    return copy.deepcopy(VARIANTS.get((model_type, key)) or VARIANTS[("*", key)])


def arithmetic_keys() -> list[tuple[str, str]]:
    return [(t, k) for t in CLASSES for k in keys_of(t) if HF_CONFIG_KEYS[t][k].kind != INERT
            and k not in ("model_type", "architectures")]  # these pick the class: test_unsupported_model_type_...


@pytest.mark.parametrize("model_type", CLASSES)
def test_every_key_transformers_defines_is_classified(model_type):
    """A key a newer transformers adds to the class (or to PretrainedConfig) fails here until it is classified."""
    cls = CLASSES[model_type]
    defined = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    defined |= set(transformers.PretrainedConfig().to_dict())
    assert sorted(defined - HF_CONFIG_KEYS[model_type].keys()) == []
    assert {spec.kind for spec in HF_CONFIG_KEYS[model_type].values()} == {HONOURED, REFUSED, INERT}


def test_every_arithmetic_key_has_a_variant():
    missing = [(t, k) for t, k in arithmetic_keys() if (t, k) not in VARIANTS and ("*", k) not in VARIANTS]
    assert missing == []


def randomize_(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.ndim == 1 and "norm" in name else 0.0
            p.copy_(base + (0.1 if p.ndim == 1 else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


def build_folder(path: Path, model_type: str, fields: dict, patch: dict) -> torch.nn.Module:
    """A random model of ``fields`` saved by transformers, its config.json then holding ``patch`` verbatim."""
    config = make_config(model_type, **fields)
    model = randomize_(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **patch}))
    return model


TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


def dropping_reader_differs(folder: Path, model_type: str, base: dict, theirs: torch.nn.Module | None) -> bool:
    """Whether a reader that drops the key computes something else: transformers' model of the config without
    it, holding the folder's weights (a tensor of another shape, or one it lacks, counts as different)."""
    plain = transformers.AutoModelForCausalLM.from_config(make_config(model_type, **base), attn_implementation="eager")
    plain = randomize_(plain)
    weights = load_file(str(folder / "model.safetensors"))
    expected = plain.state_dict()
    if any(k in expected and expected[k].shape != v.shape for k, v in weights.items()) or weights.keys() - expected.keys():
        return True
    plain.load_state_dict(weights, strict=False)
    return (logits(plain) - logits(theirs)).abs().max().item() > 1e-4


@pytest.mark.parametrize("model_type, key", arithmetic_keys(), ids=[f"{t}-{k}" for t, k in arithmetic_keys()])
def test_a_key_that_changes_the_arithmetic_is_honoured_with_equal_logits_or_refused(tmp_path, model_type, key):
    base, value = variant(model_type, key)
    spec = HF_CONFIG_KEYS[model_type][key]
    try:
        make_config(model_type, **{**base, key: value})
        fields = {**base, key: value}
    except Exception:  # noqa: BLE001  (a key the class does not take: the folder's weights are the base model's)
        fields = base
    build_folder(tmp_path / "hf", model_type, fields, {**base, key: value})
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
    except Exception:  # noqa: BLE001
        theirs = None
    unshown = (model_type, key) in NOT_ON_EVAL_LOGITS or ("*", key) in NOT_ON_EVAL_LOGITS
    assert theirs is not None or unshown, f"transformers cannot build {key}={value!r}; say why in NOT_ON_EVAL_LOGITS"

    if key == "attention_dropout":
        torch.manual_seed(0)
        assert (logits(theirs.train()) - logits(theirs.eval())).abs().max() > 1e-3
    elif not unshown:  # the test can fail: dropping the key changes the logits
        assert dropping_reader_differs(tmp_path / "hf", model_type, base, theirs)

    refused = not supports(spec, value, json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert refused == (spec.kind == REFUSED) or key == "hidden_act"  # an honoured key whose reader takes some values
    if refused:
        with pytest.raises(InputError, match=rf"hf/config.json: {key} = .* is not supported") as info:
            run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
        assert "\n" not in str(info.value)
        assert not (tmp_path / "ckpt").exists()
        return
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert (logits(ours) - logits(theirs)).abs().max().item() <= 1e-5
    if key == "max_position_embeddings":
        assert ours.cfg.max_seq_len == value


INERT_SAMPLES = {  # values a real config.json carries; the rest get a generic one
    "bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 7, "sep_token_id": 8, "decoder_start_token_id": 9,
    "use_cache": False, "dtype": "bfloat16", "torch_dtype": "bfloat16", "initializer_range": 0.5, "pretraining_tp": 2,
    "output_attentions": True, "output_hidden_states": True, "chunk_size_feed_forward": 4, "is_llama_config": True,
    "attention_bias": True, "mlp_bias": True, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
    "layer_types": ["sliding_attention", "sliding_attention"], "transformers_version": "4.40.1",
}


@pytest.mark.parametrize("model_type", CLASSES)
def test_inert_keys_change_neither_the_model_config_nor_transformers_logits(tmp_path, model_type):
    """Each key called inert, set to a sample value: the same ModelConfig (initializer_range only moves init_std),
    and, for those with a meaningful sample, the logits transformers computes from the folder do not move."""
    build_folder(tmp_path / "plain", model_type, {}, {})
    plain_json = json.loads((tmp_path / "plain" / "config.json").read_text())
    plain_cfg = model_config_from_hf(plain_json)
    reference = logits(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain", attn_implementation="eager", dtype=torch.float32).eval())
    checked = []
    for key in keys_of(model_type, INERT):
        sample = INERT_SAMPLES.get(key, "lmforge-test")
        cfg = model_config_from_hf({**plain_json, key: sample})
        expected = dataclasses.replace(plain_cfg, init_std=sample) if key == "initializer_range" else plain_cfg
        assert cfg == expected, key
        if key in INERT_SAMPLES:
            (tmp_path / "plain" / "config.json").write_text(json.dumps({**plain_json, key: sample}))
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="eager",
                                                                       dtype=torch.float32).eval()
            assert (logits(theirs) - reference).abs().max().item() == 0.0, key
            checked.append(key)
    assert len(checked) >= 10


@pytest.mark.parametrize("model_type", CLASSES)
def test_a_key_lmforge_does_not_know_is_refused_naming_it(model_type):
    config = {**CLASSES[model_type](**BASE).to_dict(), "attn_logit_softcapping": 50.0}
    with pytest.raises(InputError, match=r"^x/config.json: key 'attn_logit_softcapping' = 50.0 is not one lmforge knows for "
                                         rf"model_type '{model_type}': lmforge does not know what it does"):
        model_config_from_hf(config, where="x/config.json")


def test_auto_map_of_a_tokenizer_only_is_accepted():
    config = {**CLASSES["llama"](**BASE).to_dict(), "auto_map": {"AutoTokenizer": ["tok.T", None]}}
    assert model_config_from_hf(config) == model_config_from_hf(CLASSES["llama"](**BASE).to_dict())


def test_supported_architectures_are_the_keys_of_the_table():
    from lmforge.model.families import FAMILIES

    assert HF_CONFIG_KEYS.keys() == SUPPORTED_ARCHITECTURES.keys()
    assert SUPPORTED_ARCHITECTURES == {t: c for f in FAMILIES.values() for t, c in f.hf.classes.items()}
    assert CLASSES.keys() == FAMILIES["llama"].hf.classes.keys()  # this file's classes are the llama family's
