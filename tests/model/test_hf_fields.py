"""The llama family's config.json keys: ``HF_KEYS``, the spec tests/model/families/test_hf_config_keys.py holds
against transformers (every key of the four classes lmforge imports classified in ``HF_CONFIG_KEYS``; a key that
changes the arithmetic, set away from its default, honoured with transformers' logits or refused naming it, never
dropped; an inert key changing neither lmforge's ModelConfig nor transformers' logits), and the family's own."""

from __future__ import annotations

import os

from lmforge.model.hf import HF_CONFIG_KEYS, SUPPORTED_ARCHITECTURES, model_config_from_hf
from lmforge.model.transformer import Transformer
from tests.model.families.hf_keys import CACHE_ONLY, HfKeys, randomize_  # noqa: F401  (test_mla.py imports randomize_)

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
# keys whose change a tiny model cannot show on its logits in eval mode, and why (or what the test checks instead)
NOT_ON_EVAL_LOGITS = {
    ("llama", "sliding_window"): CACHE_ONLY,
    ("llama", "layer_types"): CACHE_ONLY,
    ("mistral", "layer_types"): CACHE_ONLY,
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


HF_KEYS = HfKeys(family="llama", classes=CLASSES, base=dict.fromkeys(CLASSES, BASE), variants=VARIANTS,
                 not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=Transformer)


def test_auto_map_of_a_tokenizer_only_is_accepted():
    config = {**CLASSES["llama"](**BASE).to_dict(), "auto_map": {"AutoTokenizer": ["tok.T", None]}}
    assert model_config_from_hf(config) == model_config_from_hf(CLASSES["llama"](**BASE).to_dict())


def test_supported_architectures_are_the_keys_of_the_table():
    from lmforge.model.families import FAMILIES

    assert HF_CONFIG_KEYS.keys() == SUPPORTED_ARCHITECTURES.keys()
    assert SUPPORTED_ARCHITECTURES == {t: c for f in FAMILIES.values() for t, c in f.hf.classes.items()}
    assert CLASSES.keys() == FAMILIES["llama"].hf.classes.keys()  # this file's classes are the llama family's
