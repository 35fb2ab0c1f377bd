"""The Gemma family computes what transformers' ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM``
compute: imported and exported through the ``lmforge import`` / ``lmforge export`` stages with
equal logits; every ``config.json`` key of both classes classified and held against transformers
(honoured with equal logits, refused with one line, or inert); trained by the one loop; LoRA,
checkpoints and presets. ``PARITY_VARIANTS`` feed tests/model/test_parity.py (training forward ==
cached decoding == pipeline split == HF export, fp32 and 16-bit)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError, atomic_directory
from lmforge.model.config import ModelConfig, MupConfig
from lmforge.model.families import build, model_config
from lmforge.model.families.gemma import Gemma
from lmforge.model.families.gemma import hf as gemma_hf
from lmforge.model.families.gemma.config import GemmaConfig
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules, merge_lora
from lmforge.stages.export import ExportRecipe, run_export
from lmforge.stages.import_hf import ImportRecipe, run_import
from tests.model.families.hf_keys import HfKeys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")  # the reference (a dev dependency)

S, F = "sliding_attention", "full_attention"
# tests/model/test_parity.py's BASE (width 64, 4 layers of 4 heads of 16, rows of up to 17 tokens) plus these
PARITY_VARIANTS = {
    # µP: the multipliers folded into (1 + w) gains, the final norm's and the QK-norm's
    "gemma:mup": dict(family="gemma", mup={"base_width": 16, "base_head_dim": 4}, qk_norm=True, n_kv_heads=2),
    # Gemma 2: both soft-caps small enough to bend the scores and logits, a scalar other than head_dim,
    # windows of 6 on every other layer, attention biases
    "gemma:gemma2": dict(family="gemma", n_kv_heads=2, attn_softcap=20.0, final_softcap=5.0, query_pre_attn_scalar=24,
                         sliding_window=6, layer_types=[S, F, S, F], qkv_bias=True, out_bias=True),
    # Gemma 3: QK-norm, a local RoPE base on three sliding layers, linear scaling on the global one only, untied
    "gemma:gemma3": dict(family="gemma", n_kv_heads=2, qk_norm=True, rope_local_theta=100.0, rope_scaling="linear",
                         rope_factor=8.0, sliding_window=5, layer_types=[S, S, S, F], final_softcap=10.0,
                         tie_embeddings=False, norm_eps=1e-5),
    "gemma:llama3-rope": dict(family="gemma", rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=2.0,
                              rope_high_freq_factor=8.0, rope_original_max_seq_len=16, n_kv_heads=1),
    # head_dim 32: the ramp runs between pairs 1.4 and 4.5, so every YaRN key shapes the tables
    "gemma:yarn-rope": dict(family="gemma", rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64,
                            rope_beta_fast=4.0, rope_beta_slow=0.5, rope_mscale=1.0, rope_mscale_all_dim=0.5,
                            rope_truncate=False, n_kv_heads=2, head_dim=32, attn_softcap=30.0),
    # LongRoPE on Gemma 3's global layer (past its original context of 2: its long factors), local base on the others
    "gemma:gemma3-longrope": dict(family="gemma", qk_norm=True, rope_scaling="longrope", rope_factor=4.0,
                                  rope_original_max_seq_len=2, rope_attention_factor=1.3,
                                  rope_short_factor=[1.0 + 0.5 * i for i in range(8)],
                                  rope_long_factor=[1.0 + 2.0 * i for i in range(8)],
                                  rope_local_theta=1000.0, sliding_window=4, layer_types=[S, F, S, S]),
}
TINY = dict(family="gemma", vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
            ffn_hidden=128, max_seq_len=64)
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random matrices, and random (1 + w) gains and biases, so a mis-mapped one changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((0.1 if p.ndim == 1 else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_folder(path: Path, config: transformers.PretrainedConfig, patch: dict | None = None) -> torch.nn.Module:
    """A random transformers model of ``config`` saved in ``path``, its config.json then holding ``patch``;
    returns the model transformers loads back from the folder (eager attention, float32)."""
    randomize_(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")).save_pretrained(path)
    if patch:
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**saved, **patch}))
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


# --------------------------------------------------------------------------- import and export stages

HF_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8)
CLASSES = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}
ROUND_TRIPS = {  # every arithmetic feature of each class at once, away from its default
    "gemma2": dict(attn_logit_softcapping=0.05, final_logit_softcapping=3.0, query_pre_attn_scalar=12,
                   attention_bias=True, tie_word_embeddings=False),
    "gemma3_text": dict(final_logit_softcapping=3.0, query_pre_attn_scalar=24, layer_types=[S, S, S, F],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
}


@pytest.mark.parametrize("model_type", CLASSES)
def test_import_and_export_compute_transformers_logits(tmp_path, model_type):
    config = CLASSES[model_type](**copy.deepcopy({**HF_BASE, **ROUND_TRIPS[model_type]}))
    theirs = hf_folder(tmp_path / "hf", config)
    assert type(theirs).__name__ == gemma_hf.CLASSES[model_type]
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert type(ours.cfg) is GemmaConfig
    imported = (logits(ours) - logits(theirs)).abs().max().item()
    assert imported <= 1e-5

    run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "out")))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    assert type(exported).__name__ == gemma_hf.CLASSES[model_type]
    assert (logits(exported) - logits(ours)).abs().max().item() <= 1e-5
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert gemma_hf.model_config_from_hf(written) == ours.cfg  # the export reads back as the checkpoint's config
    print(f"{model_type}: import max |Δ| = {imported:.2e}")


def test_a_gemma3_config_json_as_published_computes_transformers_logits(tmp_path):
    """gemma-3-1b's keys as the Hub has them (transformers 4: rope_theta, rope_local_base_freq,
    sliding_window_pattern, no layer_types or rope_parameters), at a tiny size."""
    config = transformers.Gemma3TextConfig(**HF_BASE)
    published = {**HF_BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rope_theta": 1000000,
                 "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window_pattern": 2,
                 "attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": 16,
                 "hidden_activation": "gelu_pytorch_tanh", "cache_implementation": "hybrid", "eos_token_id": [1, 106],
                 "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": True}
    hf_folder(tmp_path / "hf", config)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(published))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    run_import(ImportRecipe(hf_dir=str(tmp_path / "hf"), run_dir=str(tmp_path / "ckpt")))
    ours, _ = load_model(tmp_path / "ckpt")
    assert ours.cfg.layer_types == [S, F, S, F] and ours.cfg.rope_local_theta == 10000.0
    assert (ours.cfg.rope_theta, ours.cfg.query_pre_attn_scalar) == (1e6, None)  # 16 = head_dim
    assert (logits(ours) - logits(theirs)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", list(PARITY_VARIANTS))
def test_config_round_trips_through_config_json(variant):
    cfg = model_config({**TINY, "n_layers": 4, **PARITY_VARIANTS[variant]})
    # µP's multipliers go into the exported weights (hf.fold_mup): what comes back is the standard model
    assert gemma_hf.model_config_from_hf(hf_config_dict(cfg)) == dataclasses.replace(cfg, mup=MupConfig())


def test_hf_names_are_transformers_parameter_names():
    for fields in (dict(qkv_bias=True, out_bias=True, tie_embeddings=False), dict(qk_norm=True)):
        cfg = model_config({**TINY, **fields})
        ours = set(state_dict_to_hf(build(cfg).state_dict(), cfg))
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config_dict(cfg)))
        assert ours == set(theirs.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
        for name in build(cfg).state_dict():
            assert gemma_hf.from_hf_name(gemma_hf.to_hf_name(name)) == name


@pytest.mark.parametrize("fields, message", [
    (dict(qk_norm=True, attn_softcap=50.0), "Gemma 3 .QK-norm. does not cap attention scores"),
    (dict(rope_local_theta=10.0, sliding_window=8), "Gemma 2 has one RoPE for every layer"),
])
def test_export_of_a_model_no_gemma_class_computes_is_refused(tmp_path, fields, message):
    model = build(model_config({**TINY, **fields}))
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    with pytest.raises(InputError, match=message):
        run_export(ExportRecipe(checkpoint=str(tmp_path / "ckpt"), run_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- every config.json key

KEY_BASE = {"gemma2": HF_BASE, "gemma3_text": {**HF_BASE, "num_hidden_layers": 2, "sliding_window_pattern": 2}}
# (model_type or "*", key) -> (what else the pair of configs sets, the value away from the default)
KEY_VARIANTS: dict[tuple[str, str], tuple[dict, object]] = {
    ("*", "vocab_size"): ({}, 301),
    ("*", "hidden_size"): ({}, 96),
    ("*", "intermediate_size"): ({}, 96),
    ("*", "num_hidden_layers"): ({}, 3),
    ("*", "num_attention_heads"): ({}, 8),
    ("*", "num_key_value_heads"): ({}, 1),
    ("*", "head_dim"): ({}, 32),
    ("*", "rms_norm_eps"): ({}, 0.5),
    ("*", "tie_word_embeddings"): ({}, False),
    ("*", "max_position_embeddings"): ({}, 128),
    ("*", "hidden_activation"): ({}, "gelu"),
    ("*", "attention_bias"): ({}, True),
    ("*", "attention_dropout"): ({}, 0.1),
    ("*", "query_pre_attn_scalar"): ({}, 64),
    ("*", "final_logit_softcapping"): ({}, 2.0),
    ("*", "attn_logit_softcapping"): ({}, 0.02),
    ("*", "sliding_window"): ({}, 4),
    ("gemma2", "layer_types"): ({}, [F, S, F, S]),
    ("gemma3_text", "layer_types"): ({}, [F, S]),
    ("gemma3_text", "sliding_window_pattern"): ({"layer_types": None}, 3),
    ("gemma2", "rope_parameters"): ({}, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ("gemma3_text", "rope_parameters"): ({}, {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
    ("*", "rope_scaling"): ({}, {"rope_type": "linear", "factor": 4.0}),  # transformers < 5's spelling (Gemma 3: global)
    ("*", "rope_theta"): ({}, 300.0),
    ("gemma3_text", "rope_local_base_freq"): ({}, 300.0),
    ("gemma2", "original_max_position_embeddings"): (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, 16),
    ("*", "partial_rotary_factor"): ({}, 0.5),
    ("*", "use_bidirectional_attention"): ({}, True),
    ("*", "quantization_config"): ({}, {"quant_method": "bitsandbytes", "load_in_4bit": True}),
    ("*", "pruned_heads"): ({}, {"0": [1]}),
    ("*", "auto_map"): ({}, {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}),
}
NOT_ON_EVAL_LOGITS = {  # keys whose change the tiny model cannot show on eval logits, and why
    ("*", "max_position_embeddings"): "the context bound: no effect on a shorter input with plain RoPE; the import must keep it",
    ("*", "attention_dropout"): "acts in training only: the test checks transformers' train-mode logits move",
    ("*", "partial_rotary_factor"): "Gemma's default RoPE ignores it, but weights that set it expect part of each head "
                                    "unrotated, so lmforge refuses rather than guess",
    ("gemma3_text", "attn_logit_softcapping"): "transformers' Gemma 3 attention does not read it: a folder that sets it "
                                               "is ambiguous, so lmforge refuses it",
    ("gemma2", "use_bidirectional_attention"): "transformers' eager Gemma 2 attention keeps its causal mask, but its "
                                               "flash and flex kernels read the flag, so lmforge refuses the ambiguity",
    ("*", "quantization_config"): "building a quantized model needs a quantization backend",
    ("*", "pruned_heads"): "transformers 5 no longer prunes at load; a folder that lists pruned heads has smaller projections",
    ("*", "auto_map"): "custom modelling code (trust_remote_code) computes the model; the test builds none",
}


INERT_SAMPLES = {  # values a real config.json carries (a meaningful one where the key could matter)
    "bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 7, "use_cache": False, "dtype": "bfloat16",
    "torch_dtype": "bfloat16", "initializer_range": 0.5, "output_attentions": True, "output_hidden_states": True,
    "transformers_version": "4.42.4", "hidden_act": "gelu", "cache_implementation": "hybrid",
    "rope_local_base_freq": 300.0, "sliding_window_pattern": 3, "_sliding_window_pattern": 3,
    "original_max_position_embeddings": 16,
}


# tests/model/families/test_hf_config_keys.py holds every key of both classes against transformers by this
HF_KEYS = HfKeys(family="gemma", classes=CLASSES, base=KEY_BASE, variants=KEY_VARIANTS,
                 not_on_eval_logits=NOT_ON_EVAL_LOGITS, model_class=Gemma, inert_samples=INERT_SAMPLES,
                 partly_honoured="hidden_activation", unknown_key=("attn_logit_softcap", 50.0), randomize=randomize_)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "model_type 'gemma3' .* not supported"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma' .* not supported"),
    ({"model_type": "gemma2", "sliding_window": None}, "sliding_window = None is not supported"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 144.5}, "query_pre_attn_scalar must be a positive integer"),
    ({"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention = .* is not supported"),
    ({"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "Gemma 3's rope_parameters must map"),
    ({"model_type": "gemma2", "attn_logit_softcap": 50.0}, "key 'attn_logit_softcap' = 50.0 is not one lmforge knows"),
])
def test_a_config_lmforge_would_compute_differently_is_refused_in_one_line(config, message):
    with pytest.raises(InputError, match=rf"^x/config.json: {message}") as info:
        gemma_hf.model_config_from_hf({**HF_BASE, **config}, where="x/config.json")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- config, presets, training, LoRA

@pytest.mark.parametrize("fields, message", [
    (dict(qkv_bias=True), "Gemma's attention_bias puts biases on q, k, v and the output projection together"),
    (dict(rope_local_theta=10.0), "rope_local_theta = 10.0 is set but no layer slides"),
])
def test_a_config_gemma_cannot_compute_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        model_config({**TINY, **fields})


def test_the_shared_parts_gemma_fixes_are_not_keys_of_its_recipe():
    from lmforge.stages.pretrain import PretrainRecipe

    recipe = load_config(PretrainRecipe, None, ["model.preset=gemma3-tiny", "model.n_layers=2",
                                                "model.layer_types=[sliding_attention,full_attention]"])
    assert type(recipe.model) is GemmaConfig and recipe.model.qk_norm and recipe.model.norm == "rmsnorm"
    with pytest.raises(ConfigError, match="norm"):
        load_config(PretrainRecipe, None, ["model.family=gemma", "model.norm=layernorm"])


REAL = {  # the presets' numbers as the Hub's config.json files have them
    "gemma2-2b": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                      sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=256, rope_theta=10000.0),
    "gemma3-1b": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                      sliding_window=512, attn_logit_softcapping=None, final_logit_softcapping=None,
                      query_pre_attn_scalar=256, rope_theta=1000000, rope_local_base_freq=10000),
}
PUBLISHED_PARAMETERS = {"gemma2-2b": 2_614_341_888, "gemma3-1b": 999_885_952}


@pytest.mark.parametrize("name", list(REAL))
def test_presets_have_the_published_shapes_and_parameter_counts(name):
    cfg = ModelConfig.from_preset(name)
    written = hf_config_dict(cfg)
    assert {k: written[k] for k in REAL[name] if k in written} == {k: v for k, v in REAL[name].items() if k in written}
    if name == "gemma3-1b":  # five sliding layers in six, RoPE base 1e4 on them
        assert written["layer_types"] == [F if (i + 1) % 6 == 0 else S for i in range(26)]
        assert written["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    else:
        assert written["layer_types"] == [S, F] * 13
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**written))
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, corpus_texts, small_tokenizer_dir) -> Path:
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare
    from tests.conftest import write_jsonl

    root = tmp_path_factory.mktemp("gemma_data")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "shards"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return root / "shards"


@pytest.mark.parametrize("preset", ["gemma2-tiny", "gemma3-tiny"])
def test_pretraining_lowers_the_loss_and_its_checkpoint_reloads_with_the_same_logits(tmp_path, shards,
                                                                                     small_tokenizer_dir, preset):
    from lmforge.stages.pretrain import PretrainRecipe, run_pretrain
    from lmforge.train.metrics import read_metrics

    keys = {"run_dir": tmp_path / "run", "tokenizer": small_tokenizer_dir, "model.preset": preset, "model.vocab_size": 512,
            "model.d_model": 32, "model.n_layers": 2, "model.layer_types": "[sliding_attention,full_attention]",
            "model.head_dim": 8, "model.ffn_hidden": 64, "model.max_seq_len": 64, "model.sliding_window": 8,
            "data.datasets": f"[{{path: {shards}}}]", "data.seq_len": 32, "train.max_steps": 12, "train.lr": 1e-2,
            "train.warmup_steps": 2, "train.micro_batch_size": 4, "train.batch_tokens": 256, "train.precision": "fp32",
            "train.eval_every": 12, "train.eval_batches": 1, "train.checkpoint_every": 12, "train.tensorboard": False,
            "train.device": "cpu"}
    recipe = load_config(PretrainRecipe, None, [f"{k}={v}" for k, v in keys.items()])
    assert type(recipe.model) is GemmaConfig
    run_pretrain(recipe)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses

    # the trained checkpoint, exported, is the transformers model of the same logits
    ours, _ = load_model(tmp_path / "run")
    run_export(ExportRecipe(checkpoint=str(tmp_path / "run"), run_dir=str(tmp_path / "hf")))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    assert (logits(theirs, tokens) - logits(ours, tokens)).abs().max().item() <= 1e-5


def test_lora_applies_to_every_projection_and_merges_into_the_same_logits():
    model = randomize_(build(model_config({**TINY, **PARITY_VARIANTS["gemma:gemma3"], "n_layers": 4})))
    base = logits(model)
    names = apply_lora(model, LoraConfig(r=4, alpha=8))
    assert len(names) == 4 * 7 and set(lora_modules(model)) == set(names)
    assert torch.equal(logits(model), base)  # B starts at zero
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.1)
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3
    merge_lora(model)
    assert not lora_modules(model)
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)


def test_a_checkpoint_round_trip_keeps_the_logits(tmp_path):
    model = randomize_(build(model_config({**TINY, **PARITY_VARIANTS["gemma:gemma3-longrope"], "n_layers": 4})))
    with atomic_directory(tmp_path / "ckpt") as tmp:
        write_model_files(tmp, model, None)
        write_checksums(tmp)
    loaded, _ = load_model(tmp_path / "ckpt")  # built on the meta device, then filled
    assert loaded.cfg == model.cfg
    assert torch.equal(logits(loaded), logits(model))


def test_sliding_layers_rotate_by_the_local_base_and_full_layers_by_the_global_one():
    cfg = model_config({**TINY, **PARITY_VARIANTS["gemma:gemma3"], "n_layers": 4})
    model = randomize_(build(cfg))
    x = logits(model)
    for changed in (dict(rope_local_theta=200.0), dict(rope_theta=60000.0)):  # each table reaches the logits
        other = build(dataclasses.replace(cfg, **changed))
        other.load_state_dict(model.state_dict())
        assert (logits(other.eval()) - x).abs().max() > 1e-3
